"""What vLLM's sampler pays for per-request seeds, per decode step (issue 41).

Every sample of ours is its own seeded request (engine.sample_seed: the samples do not depend on the batch or the
layout). vLLM 0.26's V1 sampler (its V1 model runner: our MoE configs on a GPU; a dense model runs on the model
runner V2, which draws every request's noise in one kernel) draws each seeded row's exponential noise in a
Python loop, one kernel per row (``random_sample`` in vllm/v1/sample/ops/topk_topp_sampler.py: "This can be slow
because we handle each request one by one"); unseeded rows take one batched draw. This times ``random_sample`` as
vLLM calls it, every row seeded against none, at the mission's batch (512 rows) and smaller ones, over Qwen3's
vocabulary: host time until it returns (what the engine's loop waits for when the host bounds it) and wall time
with the device synchronised. Times 260 decode steps, the mission generate's count, give the cost per generate.
On CUDA also generator.seeded_noise batched (compat.batched_seeded_noise: one kernel for every seeded row), and
its kernel checked against its definition (kernels/seeded_noise.exponential_noise) and for batch independence.

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

from torchtitan_rl import compat  # noqa: E402
from torchtitan_rl.kernels.seeded_noise import exponential_noise, exponential_noise_cuda  # noqa: E402

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


def check_kernel(vocab: int) -> str:
    """The kernel's noise against its definition computed by torch on the GPU, and a row alone against the batch."""
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**63 - 1, -5] + list(range(1000, 1507)), device="cuda")
    counters = torch.arange(len(seeds), device="cuda") % 7
    rows = torch.arange(len(seeds), device="cuda")
    q = torch.empty(len(seeds), vocab, device="cuda")
    exponential_noise_cuda(q, torch.stack([rows, seeds, counters]))
    ref = exponential_noise(seeds, counters, vocab)
    alone = torch.empty(1, vocab, device="cuda")
    exponential_noise_cuda(alone, torch.stack([torch.zeros_like(rows[:1]), seeds[5:6], counters[5:6]]))
    unequal = int((q != ref).sum())
    ulps = (q.view(torch.int32) - ref.view(torch.int32)).abs().max().item()
    return (f"Kernel vs definition ({len(seeds)} rows x {vocab:,}): {unequal} of {q.numel():,} values differ, at most "
            f"{ulps} ulp; a row drawn alone equals it in the batch: {bool(torch.equal(alone[0], q[5]))}.\n")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", type=int, nargs="+", default=[512, 256, 64])
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--write", action="store_true", help="write the section into docs/benchmarks.md")
    args = p.parse_args()
    from vllm.v1.sample.ops import topk_topp_sampler as sampler

    vllm_random_sample = sampler.random_sample
    cuda = args.device == "cuda"
    if cuda:
        compat.batched_seeded_noise(exponential_noise_cuda)
    out = []
    for rows in args.rows:
        probs = torch.softmax(torch.randn(rows, args.vocab, device=args.device), dim=-1)
        generators = {i: torch.Generator(device=args.device).manual_seed(i) for i in range(rows)}
        unseeded = time_call(lambda: vllm_random_sample(probs, {}), device=args.device, repeats=args.repeats)
        seeded = time_call(lambda: vllm_random_sample(probs, generators), device=args.device, repeats=args.repeats)
        batched = (time_call(lambda: sampler.random_sample(probs, generators), device=args.device,
                             repeats=args.repeats) if cuda else None)
        out.append((rows, unseeded, seeded, batched))
    ms = lambda t: f"{t[0] * 1e3:.2f} / {t[1] * 1e3:.2f}" if t else "(CUDA only)"  # noqa: E731
    rows_md = [[rows, ms(u), ms(s), f"{(s[1] - u[1]) * STEPS:.2f}", ms(b),
                f"{(b[1] - u[1]) * STEPS:.2f}" if b else ""] for rows, u, s, b in out]
    body = (f"vLLM's `random_sample` over a {args.vocab:,}-token vocabulary, median of {args.repeats} calls after 2 "
            f"warm-up calls; ms host (until it returns) / ms wall (device synchronised). Batched: "
            f"generator.seeded_noise batched.\n\n"
            + table(["rows", "unseeded ms", "every row seeded (vLLM) ms", f"vLLM seeds' cost per {STEPS}-step "
                     "generate s", "every row seeded (batched) ms", "batched seeds' cost s"], rows_md))
    if cuda:
        body += "\n" + check_kernel(args.vocab)
    print(body)
    if args.write:
        write_section(f"Seeded sampling, vLLM's per-request loop ({args.device})", device=args.device, body=body)


if __name__ == "__main__":
    main()
