"""Each seeded sample's exponential noise for one decode step, every row in one batched draw (generator.seeded_noise
batched).

vLLM samples a token as argmax(probs / q) with q ~ Exp(1) per vocabulary entry; a request with its own seed (every
sample of ours: engine.sample_seed) draws its row of q from its own torch.Generator, one kernel per row and step
(vLLM 0.26's V1 sampler, which runs our model on a GPU; compat.batched_seeded_noise puts this in its place). Here
row r's noise is a counter-based hash of (its seed, its draw count, the vocabulary index): the same numbers whatever
the batch around it, so a seed still gives the same samples in any layout, in one kernel for every row. Not vLLM's
stream: a run with it samples other tokens than one without, as reproducibly. ``exponential_noise`` is the
definition (torch integer ops, any device); on CUDA ``exponential_noise_cuda`` computes the same numbers in one
Triton kernel.
"""

import torch
import triton
import triton.language as tl
import triton.language.extra.libdevice as libdevice

MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x85EBCA6B, 0xC2B2AE35  # murmur3's 32-bit finaliser
_GOLDEN = 0x9E3779B9


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on uint32 values held in int64 (products wrap in 64 bits; the low 32 are exact)."""
    h = h ^ (h >> 16)
    h = (h * _M1) & MASK32
    h = h ^ (h >> 13)
    h = (h * _M2) & MASK32
    return h ^ (h >> 16)


def row_keys(seeds_R: torch.Tensor, counters_R: torch.Tensor) -> torch.Tensor:
    """uint32 (in int64) key of each row's draw: its 64-bit seed's two halves and its draw count, mixed."""
    lo, hi = seeds_R & MASK32, (seeds_R >> 32) & MASK32
    key = _fmix32(lo ^ _GOLDEN)
    key = _fmix32(key ^ hi)
    return _fmix32(key ^ (counters_R & MASK32))


def exponential_noise(seeds_R: torch.Tensor, counters_R: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] float32 Exp(1) noise: row r from (seeds_R[r], counters_R[r]) alone."""
    key_R1 = row_keys(seeds_R.long(), counters_R.long())[:, None]
    col_1V = torch.arange(vocab, device=seeds_R.device, dtype=torch.int64)[None, :]
    h = _fmix32(key_R1 ^ _fmix32(col_1V * _GOLDEN & MASK32))
    return _exponential(h.to(torch.float32))


def _exponential(h_f32: torch.Tensor) -> torch.Tensor:
    """-log(1 - u) with u = (h + 0.5) / 2**32: the small q that decide the argmax come from small u, where
    float32 resolves them finely (as vLLM's V2 sampler does for its Gumbel noise)."""
    u = (h_f32 + 0.5) * (1.0 / 4294967296.0)
    return -torch.log1p(-u)


@triton.jit
def _fmix32_tl(h):
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


@triton.jit
def _noise_kernel(q_ptr, q_stride, ids_ptr, n_rows, vocab, BLOCK: tl.constexpr):
    """Row r of the draw: ids_ptr holds [rows | seeds | counters], n_rows each (``row_keys`` computed here, so a
    step is one launch)."""
    r = tl.program_id(0)
    row = tl.load(ids_ptr + r)
    seed = tl.load(ids_ptr + n_rows + r)
    counter = tl.load(ids_ptr + 2 * n_rows + r)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _fmix32_tl(lo ^ 0x9E3779B9)
    key = _fmix32_tl(key ^ hi)
    key = _fmix32_tl(key ^ (counter & 0xFFFFFFFF).to(tl.uint32))
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    h = _fmix32_tl(key ^ _fmix32_tl(col.to(tl.uint32) * 0x9E3779B9))
    u = (h.to(tl.float32) + 0.5) * (1.0 / 4294967296.0)
    q = -libdevice.log1p(-u)
    tl.store(q_ptr + row * q_stride + col, q, mask=col < vocab)


def exponential_noise_cuda(q_BV: torch.Tensor, ids_3R: torch.Tensor) -> None:
    """Write ``exponential_noise``'s rows into ``q_BV`` (float32, CUDA) in one kernel: ``ids_3R`` (int64, CUDA)
    holds the rows of q_BV to fill, their seeds and their draw counts."""
    n_rows = ids_3R.shape[1]
    block = 2048
    grid = (n_rows, triton.cdiv(q_BV.shape[1], block))
    _noise_kernel[grid](q_BV, q_BV.stride(0), ids_3R, n_rows, q_BV.shape[1], BLOCK=block)
