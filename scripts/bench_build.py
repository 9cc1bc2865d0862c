"""Host time of a step outside generate, train and sync: grpo/builder.py's build (score, advantages, packing, the
statistics) at the mission's batch shape, the logprob recompute left out (a stand-in trainer returns zeros: on a GPU
the recompute is a forward of its own, timed as recompute_s in metrics.jsonl).

    python scripts/bench_build.py [--config run_configs/qwen3_0.6b.toml] [--repeats 5] [--no-write]

The config's prompts_per_step x group_size rows of the digits task (the config's timing harness without a
checkpoint), every completion grpo's generator.sampling.max_tokens long with a logprob per token.
"""

import argparse
import cProfile
import pstats
import random
import statistics
import time

import torch
import torch.distributed as dist

from torchtitan_rl.config import load_toml
from torchtitan_rl.engine.rollouts import Rollouts
from torchtitan_rl.grpo import build_task
from torchtitan_rl.grpo.batch import pack_rollouts
from torchtitan_rl.grpo.builder import BatchBuilder


class ZeroLogprobs:
    """The builder's trainer: one data-parallel rank, logprobs of 0."""

    dp_rank, dp_size = 0, 1

    def token_logprobs(self, tokens_BL, *, temperature, mask_BL=None):
        return torch.zeros(tokens_BL.shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="run_configs/qwen3_0.6b.toml")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-write", action="store_true", help="print, leave docs/benchmarks.md alone")
    args = parser.parse_args()
    cfg = load_toml(args.config)
    completion = cfg.generator.sampling.max_tokens
    task = build_task("digits", cfg.task, tokenizer_dir=None,
                      max_prompt_tokens=cfg.generator.max_model_len - completion)
    rng = random.Random(0)
    P, G = cfg.grpo.prompts_per_step, cfg.grpo.group_size
    prompts = task.sample_prompts(P, generator=rng)
    prompt_ids = [list(p.token_ids) for p in prompts for _ in range(G)]
    completions = [[rng.randrange(3, task.vocab_size) for _ in range(completion)] for _ in range(P * G)]
    logprobs = [[-rng.random() for _ in range(completion)] for _ in range(P * G)]
    rollouts = Rollouts(prompt_ids, completions, logprobs, 0, 1.0, 0.0)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True), rank=0,
                            world_size=1)
    builder = BatchBuilder(cfg, task=task, trainer=ZeroLogprobs(), reference=None, device=torch.device("cpu"))

    def timed(fn) -> float:
        fn()
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    build_s = timed(lambda: builder.build(prompts, rollouts, refill=None))
    pack_s = timed(lambda: pack_rollouts(prompt_ids, completions, logprobs, pad_id=task.pad_id))
    profile = cProfile.Profile()
    profile.enable()
    builder.build(prompts, rollouts, refill=None)
    profile.disable()
    stats = pstats.Stats(profile)
    parts = {}
    for (file, _, name), (_, _, _, cumulative, _) in stats.stats.items():
        if name in ("score_groups", "pack_rollouts", "group_advantages", "logprob_mismatch", "importance_weights",
                    "rollout_metrics"):
            parts[name] = cumulative
    rows = P * G
    tokens = len(prompt_ids[0]) + completion
    body = (f"{args.config}: {P} prompts x {G} samples = {rows} rows of {tokens} tokens (digits prompts of "
            f"{len(prompt_ids[0])} tokens + {completion}), torch threads {torch.get_num_threads()}, median of "
            f"{args.repeats}.\n\n| part | ms |\n|---|---|\n"
            f"| build (no recompute) | {1000 * build_s:.1f} |\n| of it, pack_rollouts alone | {1000 * pack_s:.1f} |\n"
            + "".join(f"| {name} (one profiled build) | {1000 * s:.1f} |\n" for name, s in sorted(parts.items())))
    if args.no_write:
        print(body)
    else:
        from bench_common import write_section  # scripts/, beside this file

        write_section("Host time of a step's batch build (cpu)", device="cpu", body=body)


if __name__ == "__main__":
    main()
