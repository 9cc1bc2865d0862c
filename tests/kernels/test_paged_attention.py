"""The CUDA batch-invariant attention kernel: a query row's bits depend on the row only.

Not on whether the row comes from the trainer's full sequences or from a
generator step on vLLM's paged cache (decode or prefill chunk), nor on the
other sequences in the call. On a GPU the compiled kernel runs on bf16. On
CPU the same tests run in a child process under Triton's interpreter
(TRITON_INTERPRET=1 must be set before triton is imported), on fp32 values
(the interpreter's bf16 dot is broken), with its dot replaced by one that
sums each element over k in a fixed order whatever the row's place in the
tile, as an MMA does: numpy's GEMM would not, and the comparisons are
bitwise there too. That checks the kernel's tiling, masking, paging and
reduction order, not the GPU's bits.
"""

import os
import subprocess
import sys

import pytest
import torch

from torchtitan_rl.kernels import paged_attention

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

if INTERPRETED:
    from triton.runtime import interpreter

    def _dot_fixed_order(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.copy()
        for k in range(a.data.shape[-1]):
            acc = acc + a.data[..., :, k : k + 1] * b.data[..., k : k + 1, :]
        return interpreter.TensorHandle(acc, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = _dot_fixed_order


@pytest.fixture(params=(["cpu"] if INTERPRETED else []) + (["cuda"] if torch.cuda.is_available() else []))
def device_dtype(request):
    """(device, dtype) the kernel runs on."""
    return request.param, torch.bfloat16 if request.param == "cuda" else torch.float32


@pytest.mark.skipif(INTERPRETED, reason="already under the interpreter")
@pytest.mark.slow
def test_kernel_under_triton_interpreter_on_cpu():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not interpreter"],
        env={**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True, text=True,
    )
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


def _randn(*shape, g, device, dtype):
    return torch.randn(*shape, generator=g).to(torch.bfloat16).to(device, dtype)


def _reference(q_BLHD, k_BLGD, v_BLGD, scale):
    rep = q_BLHD.shape[2] // k_BLGD.shape[2]
    q, k, v = (t.double().transpose(1, 2) for t in (q_BLHD, k_BLGD, v_BLGD))
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(2, 1, 16), (4, 2, 32), (10, 2, 64), (16, 8, 128)])
def test_trainer_attention_matches_causal_softmax_attention(device_dtype, heads, kv_heads, head_dim):
    device, dtype = device_dtype
    g = torch.Generator().manual_seed(heads)
    q = _randn(3, 70, heads, head_dim, g=g, device=device, dtype=dtype)
    k, v = (_randn(3, 70, kv_heads, head_dim, g=g, device=device, dtype=dtype) for _ in range(2))
    got = paged_attention.contiguous_attention(q, k, v, scale=head_dim**-0.5)
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # bf16 outputs / fp32 math
    torch.testing.assert_close(got.double(), _reference(q, k, v, head_dim**-0.5), atol=atol, rtol=0)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 32), (10, 2, 64), (16, 8, 128)])
def test_rows_are_the_same_bits_in_the_trainer_and_in_any_generator_step(device_dtype, heads, kv_heads, head_dim):
    device, dtype = device_dtype
    g = torch.Generator().manual_seed(7)
    n, block_size, scale = 75, 16, head_dim**-0.5

    q_LHD = _randn(n, heads, head_dim, g=g, device=device, dtype=dtype)
    k_LGD, v_LGD = (_randn(n, kv_heads, head_dim, g=g, device=device, dtype=dtype) for _ in range(2))

    # The trainer: our sequence second of three whole sequences (the others: its padding neighbours).
    batch = lambda t: torch.stack([_randn(*t.shape, g=g, device=device, dtype=dtype), t,  # noqa: E731
                                   _randn(*t.shape, g=g, device=device, dtype=dtype)])
    whole = paged_attention.contiguous_attention(batch(q_LHD), batch(k_LGD), batch(v_LGD), scale=scale)[1]

    # The generator's cache in vLLM 0.26's FLASH_ATTN layout (compat.vllm_paged_kv_cache's views of
    # [blocks, kv heads, block size, 2 * head_dim]): our blocks scattered, every slot nobody wrote
    # NaN (never read).
    num_blocks = 24
    kv = torch.full((num_blocks, kv_heads, block_size, 2 * head_dim), float("nan"), device=device, dtype=dtype)
    caches = kv.transpose(1, 2).split(head_dim, dim=-1)
    ours = torch.randperm(num_blocks, generator=g)[: -(-n // block_size)]
    positions = torch.arange(n)
    for cache, src in zip(caches, (k_LGD, v_LGD)):
        cache[ours[positions // block_size], positions % block_size] = src
    other_blocks = [b for b in range(num_blocks) if b not in ours.tolist()][:2]
    for cache in caches:  # the other sequence's two blocks: finite keys
        cache[other_blocks] = _randn(2, block_size, kv_heads, head_dim, g=g, device=device, dtype=dtype)

    def step(ranges: list[tuple[int, int]], *, padded: int = 0) -> list[torch.Tensor]:
        """One generator forward: sequence i computes our positions ranges[i] (earlier ones cached);
        a sequence of 20 cached keys decoding one token rides along, first. ``padded``: as a CUDA
        graph pads a batch, that many requests of no token and no key, and as many extra rows."""
        tables = [torch.tensor(other_blocks + [0] * (len(ours) - 2))] + [ours] * (len(ranges) + padded)
        q = [_randn(1, heads, head_dim, g=g, device=device, dtype=dtype)] + [q_LHD[a:b] for a, b in ranges]
        q.append(_randn(padded, heads, head_dim, g=g, device=device, dtype=dtype))
        lens = [1] + [b - a for a, b in ranges]
        out = paged_attention.attention(
            torch.cat(q), *caches,
            block_table=torch.stack(tables).to(device, torch.int32),
            query_start_loc=torch.tensor([0] + lens + [0] * padded, device=device).cumsum(0).to(torch.int32),
            seq_lens=torch.tensor([20] + [b for _, b in ranges] + [0] * padded, device=device, dtype=torch.int32),
            scale=scale,
        )
        return list(out[1 : sum(lens)].split(lens[1:]))

    for p in (0, 1, 15, 16, 17, 63, 64, 65, n - 1):  # decode steps, alone and beside a prefill
        assert torch.equal(step([(p, p + 1)])[0], whole[p : p + 1]), p
        assert torch.equal(step([(p, p + 1), (0, 9)])[0], whole[p : p + 1]), p
        assert torch.equal(step([(p, p + 1)], padded=3)[0], whole[p : p + 1]), p
    for a, b in ((0, n), (0, 5), (3, 40), (40, n)):  # prefill chunks after a cached prefix
        assert torch.equal(step([(a, b)])[0], whole[a:b]), (a, b)
    together = step([(50, 51), (0, 30), (30, 75)])  # three of ours in one call
    assert torch.equal(torch.cat(together[1:] + [together[0]]), torch.cat([whole[:75], whole[50:51]]))
