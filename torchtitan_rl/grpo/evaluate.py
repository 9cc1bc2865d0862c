"""Held-out evaluation: greedy pass@1 (optionally mean@k) on the generator that serves training.

It asks the generator through the loop's own interface (``task.rollouts``), so
it runs in every layout, with its own sampling settings and seeds. It never
changes a training sample: every request carries its own seed, and the
loop evaluates right after a step's rollouts are drawn (its KV blocks in
vLLM's prefix cache are dropped by the next sync).
"""

import dataclasses
import time

from torchtitan_rl.config import EvalConfig, SamplingConfig
from torchtitan_rl.grpo.tasks.base import Task

SEED_OFFSET = 1 << 20
"""Evaluation seeds stay clear of the training rollouts' (job.seed * 1_000_003 + step); the per-sample
mixing (generator.sample_seed) folds every seed into int64."""


class Evaluator:
    def __init__(self, config: EvalConfig, *, task: Task, spec: str, sampling: SamplingConfig, seed: int,
                 max_total_tokens: int, samples: int = 0) -> None:
        prompts = task.heldout_prompts()
        if not prompts:
            raise ValueError(f"eval.every_n_steps: grpo.task {spec!r} has no held-out set")
        self.config = config
        self.task = task
        self.prompts = prompts[: config.num_prompts] if config.num_prompts else prompts
        self.seed = seed
        self.num_samples = samples
        self.samples: list[dict] = []
        """The last run's first ``samples`` greedy completions: prompt, completion, reward, correct, version."""
        self.max_total_tokens = max_total_tokens
        max_tokens = config.max_tokens or sampling.max_tokens
        # Greedy: temperature 0 is vLLM's argmax; top-p/top-k off so nothing else changes the choice.
        self.greedy = SamplingConfig(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens)
        self.sampled = dataclasses.replace(sampling, max_tokens=max_tokens)

    def due(self, step: int) -> bool:
        """Before step 0 and every eval.every_n_steps steps (a resumed run evaluates where an uninterrupted one does)."""
        return step % self.config.every_n_steps == 0

    def run(self, generator, *, step: int) -> dict[str, float]:
        """Evaluate the weights the generator serves now; every trainer rank calls it (rollouts is collective)."""
        started = time.perf_counter()
        seed = SEED_OFFSET + self.seed * 1_000_003 + step
        play = dict(seed=seed, max_total_tokens=self.max_total_tokens)  # a multi-turn task plays its episodes
        greedy = self.task.rollouts(generator, self.prompts, n=1, sampling=self.greedy, **play)
        hits = [self.task.correct(p, c) for p, c in zip(self.prompts, greedy.completion_ids)]
        self.samples = [
            {"prompt": p.text, "completion": self.task.tokenizer.decode(c, skip_special_tokens=True),
             "reward": self.task.reward(p, c), "correct": bool(hit), "version": greedy.weight_version}
            for p, c, hit in list(zip(self.prompts, greedy.completion_ids, hits))[: self.num_samples]
        ]
        metrics = {
            "eval_accuracy": sum(hits) / len(hits),
            "eval_prompts": len(hits),
            "eval_completion_tokens": sum(map(len, greedy.completion_ids)) / len(hits),
            "eval_weight_version": greedy.weight_version,
        }
        k = self.config.mean_at_k
        if k:
            sampled = self.task.rollouts(generator, self.prompts, n=k, sampling=self.sampled, **play)
            hits = [self.task.correct(self.prompts[i // k], c) for i, c in enumerate(sampled.completion_ids)]
            metrics[f"eval_mean_at_{k}"] = sum(hits) / len(hits)
        metrics["eval_s"] = time.perf_counter() - started
        return metrics
