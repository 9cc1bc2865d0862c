"""Evaluation: greedy pass@1 (optionally mean@k) of the task's held-out set and of named sets, on the generator.

It asks the generator through the loop's own interface (``rollouts``), so
it runs in every layout, with its own sampling settings and seeds. It never
changes a training sample: every request carries its own seed, and the
loop evaluates right after a step's rollouts are drawn (its KV blocks in
vLLM's prefix cache are dropped by the next sync). The standalone evaluator
(torchtitan_rl/evaluate.py) runs this same class on a vLLM engine that loaded
an HF folder.

Metrics: the held-out set's as eval_accuracy, eval_accuracy_se, ...; a named
set's with ``/NAME`` appended (eval_accuracy/gsm8k_style). A standard error is
the population standard deviation of the per-problem scores (0/1 greedy, the
mean of k samples for mean@k) over sqrt(problems).
"""

import dataclasses
import math
import time

from torchtitan_rl.config import EvalConfig, SamplingConfig
from torchtitan_rl.grpo.eval_sets import EvalSet
from torchtitan_rl.grpo.tasks.base import Prompt, Task

SEED_OFFSET = 1 << 20
"""Evaluation seeds stay clear of the training rollouts' (job.seed * 1_000_003 + step); the per-sample
mixing (generator.sample_seed) folds every seed into int64."""

HELDOUT = "heldout"
"""The task's own held-out set in samples.jsonl (its metrics carry no /NAME)."""


@dataclasses.dataclass
class Suite:
    """One set as the evaluator scores it."""

    name: str
    source: Task | EvalSet
    """Asks (``rollouts``) and scores (``correct``, ``reward``) its prompts."""
    prompts: list[Prompt]
    greedy: SamplingConfig
    sampled: SamplingConfig
    """mean@k's: the training sampling at the set's length limit."""
    mean_at_k: int

    def key(self, metric: str) -> str:
        return f"eval_{metric}" if self.name == HELDOUT else f"eval_{metric}/{self.name}"


def standard_error(scores: list[float]) -> float:
    """Population standard deviation of per-problem scores / sqrt(problems)."""
    n = len(scores)
    mean = sum(scores) / n
    return math.sqrt(sum((s - mean) ** 2 for s in scores) / n / n)


class Evaluator:
    def __init__(self, config: EvalConfig, *, task: Task | None, spec: str, sampling: SamplingConfig, seed: int,
                 max_total_tokens: int, samples: int = 0, sets: list[EvalSet] = ()) -> None:
        """``task``'s held-out set (None: named sets only) and ``sets``; ``samples``: completions of each set
        kept in ``samples`` for samples.jsonl."""
        heldout = task.heldout_prompts() if task is not None else []
        if not heldout and not sets:
            raise ValueError(f"eval.every_n_steps: grpo.task {spec!r} has no held-out set; add eval.sets")
        self.config = config
        self.seed = seed
        self.num_samples = samples
        self.max_total_tokens = max_total_tokens
        self.suites: list[Suite] = []
        if heldout:
            prompts = heldout[: config.num_prompts] if config.num_prompts else heldout
            self.suites.append(self._suite(HELDOUT, task, prompts, config.max_tokens, config.mean_at_k, sampling))
        for s in sets:
            self.suites.append(self._suite(s.name, s, s.prompts, s.config.max_tokens or config.max_tokens,
                                           s.config.mean_at_k, sampling))
        self.samples: list[dict] = []
        """The last run's first ``samples`` greedy completions of each set: set, prompt, completion, reward,
        correct, version."""
        self.results: dict[str, list[dict]] = {}
        """The last run's every greedy completion, per set: prompt, answer, completion, correct."""

    @staticmethod
    def _suite(name, source, prompts, max_tokens, k, sampling: SamplingConfig) -> Suite:
        max_tokens = max_tokens or sampling.max_tokens
        # Greedy: temperature 0 is vLLM's argmax; top-p/top-k off so nothing else changes the choice.
        greedy = SamplingConfig(temperature=0.0, top_p=1.0, top_k=-1, max_tokens=max_tokens)
        return Suite(name, source, prompts, greedy, dataclasses.replace(sampling, max_tokens=max_tokens), k)

    def due(self, step: int) -> bool:
        """Before step 0 and every eval.every_n_steps steps (a resumed run evaluates where an uninterrupted one does)."""
        return step % self.config.every_n_steps == 0

    def run(self, generator, *, step: int) -> dict[str, float]:
        """Evaluate the weights the generator serves now; every trainer rank calls it (rollouts is collective)."""
        started = time.perf_counter()
        seed = SEED_OFFSET + self.seed * 1_000_003 + step
        play = dict(seed=seed, max_total_tokens=self.max_total_tokens)  # a multi-turn task plays its episodes
        metrics: dict[str, float] = {}
        self.samples, self.results, version = [], {}, None
        for suite in self.suites:
            source, prompts = suite.source, suite.prompts
            greedy = source.rollouts(generator, prompts, n=1, sampling=suite.greedy, **play)
            version = greedy.weight_version
            hits = [bool(source.correct(p, c)) for p, c in zip(prompts, greedy.completion_ids)]
            texts = [source.completion_text(c) for c in greedy.completion_ids]
            self.results[suite.name] = [
                {"prompt": p.text, "answer": p.target, "completion": t, "correct": hit}
                for p, t, hit in zip(prompts, texts, hits)
            ]
            self.samples += [
                {"set": suite.name, "prompt": p.text, "completion": t, "reward": source.reward(p, c),
                 "correct": hit, "version": version}
                for p, c, t, hit in list(zip(prompts, greedy.completion_ids, texts, hits))[: self.num_samples]
            ]
            scores = [float(h) for h in hits]
            metrics[suite.key("accuracy")] = sum(scores) / len(scores)
            metrics[suite.key("accuracy_se")] = standard_error(scores)
            metrics[suite.key("prompts")] = len(scores)
            metrics[suite.key("completion_tokens")] = sum(map(len, greedy.completion_ids)) / len(scores)
            k = suite.mean_at_k
            if k:
                sampled = source.rollouts(generator, prompts, n=k, sampling=suite.sampled, **play)
                per_problem = [
                    sum(source.correct(p, c) for c in sampled.completion_ids[i * k:(i + 1) * k]) / k
                    for i, p in enumerate(prompts)
                ]
                metrics[suite.key(f"mean_at_{k}")] = sum(per_problem) / len(per_problem)
                metrics[suite.key(f"mean_at_{k}_se")] = standard_error(per_problem)
        metrics["eval_weight_version"] = version
        metrics["eval_s"] = time.perf_counter() - started
        return metrics
