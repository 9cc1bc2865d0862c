"""What vLLM's sampler pays for per-request seeds, per decode step (issue 41).

Every sample of ours is its own seeded request (engine.sample_seed: the samples do not depend on the batch or the
layout). vLLM 0.26's V1 sampler, which runs our model on a GPU, then draws each seeded row's exponential noise in a
Python loop, one kernel per row (``random_sample`` in vllm/v1/sample/ops/topk_topp_sampler.py: "This can be slow
because we handle each request one by one"); unseeded rows take one batched draw. This times ``random_sample`` as
vLLM calls it, every row seeded against none, at the mission's batch (512 rows) and smaller ones, over Qwen3's
vocabulary: host time until it returns (what the engine's loop waits for when the host bounds it) and wall time
with the device synchronised. Times 260 decode steps, the mission generate's count, give the cost per generate.

    python scripts/bench_seeded_sampling.py --device cuda [--rows 512 256 64] [--vocab 151936] [--write]
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import synchronize, table, write_section  # noqa: E402

STEPS = 260
"""Decode steps of the mission generate (run_configs/qwen3_0.6b.toml: 512 samples of 256 tokens)."""


def time_call(fn, *, device: str, repeats: int) -> tuple[float, float]:
    """Median host seconds until ``fn`` returns and median wall seconds with the device synchronised."""
    for _ in range(2):
        fn()
    synchronize(device)
    host, wall = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        host.append(time.perf_counter() - start)
        synchronize(device)
        wall.append(time.perf_counter() - start)
    return statistics.median(host), statistics.median(wall)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, nargs="+", default=[512, 256, 64])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--write", action="store_true", help="write the section into docs/benchmarks.md")
    args = p.parse_args()
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample

    out = []
    for rows in args.rows:
        probs = torch.softmax(torch.randn(rows, args.vocab, device=args.device), dim=-1)
        generators = {i: torch.Generator(device=args.device).manual_seed(i) for i in range(rows)}
        unseeded = time_call(lambda: random_sample(probs, {}), device=args.device, repeats=args.repeats)
        seeded = time_call(lambda: random_sample(probs, generators), device=args.device, repeats=args.repeats)
        out.append((rows, unseeded, seeded))
    rows_md = [[rows, f"{u[0] * 1e3:.2f} / {u[1] * 1e3:.2f}", f"{s[0] * 1e3:.2f} / {s[1] * 1e3:.2f}",
                f"{(s[1] - u[1]) * STEPS:.2f}"] for rows, u, s in out]
    body = (f"vLLM's `random_sample` over a {args.vocab:,}-token vocabulary, median of {args.repeats} calls after 2 "
            f"warm-up calls; ms host (until it returns) / ms wall (device synchronised).\n\n"
            + table(["rows", "unseeded ms", "every row seeded ms", f"seeds' cost per {STEPS}-step generate s"],
                    rows_md))
    print(body)
    if args.write:
        write_section(f"Seeded sampling, vLLM's per-request loop ({args.device})", device=args.device, body=body)


if __name__ == "__main__":
    main()
