"""kernels/seeded_noise.py: each seeded sample's noise, drawn for every row at once (generator.seeded_noise batched).
The definition is checked here on CPU, and the Triton kernel's hashing and row placement in Triton's interpreter; the
compiled kernel (libdevice's log1p included) against the definition on a GPU (scripts/bench_seeded_sampling.py)."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torchtitan_rl import compat
from torchtitan_rl.kernels.seeded_noise import exponential_noise

SEEDS = torch.tensor([0, 1, 2**40 + 7, 2**63 - 1, 123456789])


def test_a_row_is_its_seed_and_count_alone_whatever_the_batch():
    counters = torch.tensor([0, 3, 1, 9, 2])
    whole = exponential_noise(SEEDS, counters, 1000)
    for r in range(len(SEEDS)):
        assert torch.equal(whole[r], exponential_noise(SEEDS[r:r + 1], counters[r:r + 1], 1000)[0])
    assert torch.equal(whole.flip(0), exponential_noise(SEEDS.flip(0), counters.flip(0), 1000))
    assert not torch.equal(whole[0], exponential_noise(SEEDS[:1], torch.tensor([1]), 1000)[0])  # next draw
    assert len({tuple(row[:8].tolist()) for row in whole}) == len(SEEDS)  # seeds differ


def test_the_noise_is_exponential_down_to_the_small_values_that_pick_the_token():
    q = exponential_noise(torch.arange(64) * 7919, torch.zeros(64, dtype=torch.int64), 16384).double()
    n = q.numel()
    assert abs(q.mean().item() - 1) < 5 / math.sqrt(n)  # sd of the mean 1/sqrt(n)
    for x in (math.log(2), 0.05, 3.0):
        p = 1 - math.exp(-x)
        assert abs((q < x).double().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n), x
    tiny = (q < 1e-4).double().mean().item()  # argmax(probs / q) is decided by the smallest q of a row
    assert abs(tiny - 1e-4) < 5 * math.sqrt(1e-4 / n)
    assert bool(torch.isfinite(q).all()) and bool((q > 0).all())


def test_argmax_of_probs_over_the_noise_samples_the_distribution():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
    draws = 40000
    q = exponential_noise(torch.arange(draws) * 104729 + 11, torch.arange(draws) % 5, len(probs))
    counts = torch.bincount((probs / q).argmax(dim=-1), minlength=len(probs)).double()
    expected = probs.double() * draws
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 30, (chi2, counts.tolist())  # 7 degrees of freedom: P(chi2 > 30) ~ 1e-4


@pytest.mark.slow  # imports vLLM's sampler: ~4 s
def test_the_sampler_patch_leaves_cpu_sampling_to_vllm():
    from vllm.v1.sample.ops import topk_topp_sampler as sampler

    probs = torch.softmax(torch.randn(4, 32, generator=torch.Generator().manual_seed(0)), dim=-1)

    def draw():
        return sampler.random_sample(probs.clone(), {i: torch.Generator().manual_seed(i) for i in range(4)})

    before = draw()
    compat.batched_seeded_noise(lambda *args: (_ for _ in ()).throw(AssertionError("not on CPU")))
    compat.batched_seeded_noise(None)  # idempotent: the first stays
    assert sampler.random_sample.batched_seeded_noise
    assert torch.equal(draw(), before)


INTERPRETED = textwrap.dedent("""
    import types, torch
    import triton.language as tl
    from torchtitan_rl.kernels import seeded_noise as sn
    # The interpreter has no libdevice: a plain log stands in for log1p (same values to float32 rounding here).
    sn._noise_kernel.fn.__globals__["libdevice"] = types.SimpleNamespace(log1p=lambda x: tl.log(1.0 + x))
    seeds = torch.tensor([0, 1, 2**40 + 7, 2**63 - 1, -5, -2**63, 12345678901])
    counters = torch.tensor([0, 3, 7, 2**33 + 1, 5, 1, 999])
    rows = torch.tensor([0, 2, 3, 5, 6, 8, 9])
    q = torch.full((10, 2500), -1.0)
    sn.exponential_noise_cuda(q, torch.stack([rows, seeds, counters]))
    print((q[rows] - sn.exponential_noise(seeds, counters, 2500)).abs().max().item(), bool(q[[1, 4, 7]].eq(-1).all()))
""")


@pytest.mark.slow  # a fresh interpreter that imports torch and Triton: ~5 s
def test_the_kernel_draws_the_definitions_noise_into_the_rows_it_is_given():
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when the kernel is decorated
    out = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True,
                         check=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    diff, untouched = out.stdout.split()
    assert float(diff) < 1e-6 and untouched == "True", out.stdout  # seeds' sign bit and 64-bit counters included
