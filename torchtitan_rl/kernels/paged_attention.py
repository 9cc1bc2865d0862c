"""CUDA batch-invariant attention: one Triton kernel for the trainer and the generator.

The generator calls it on vLLM's paged KV cache (decode and prefill alike),
the trainer on its contiguous K/V seen as one block per sequence. A query
row's result depends on its query, its keys and its position only, because
every reduction over keys runs in an order fixed by the row itself:

- One program takes a tile of ``_ROWS`` query rows (a few tokens of one
  sequence x the query heads of one KV head) and walks the keys in blocks of
  ``_BLOCK_N`` from key 0 with an online softmax. A row's blocks are the same
  in every call; the blocks past its own position (the tile's other rows
  reach further) are all masked, and a masked block is an exact no-op
  (running max unchanged, rescale factor exp2(0) = 1, probabilities 0).
- Both products are ``tl.dot`` of one tile shape; an output element of an MMA
  depends on its row and column only, reduced in an order fixed by the
  compiled kernel, the same binary on both sides (same constexprs, same
  ``num_warps``, one dtype, strides that are multiples of 16 on both; the
  block size, the block table's row stride and the index tensors' pointers
  are not specialised, so a block of 16 and one of 181 positions compile to
  the same code).
- Keys past a tile's last position are never loaded (masked to 0), so stale
  or uninitialised cache slots cannot turn a 0 probability into NaN.

No split-KV, no atomics, no host work: the launch reads only device tensors,
so a CUDA graph can replay it (vLLM captures the generator's decode steps).
"""

import torch
import triton
import triton.language as tl

_ROWS = 16  # query rows per program (tokens x query heads of one KV head); the MMA's M
_BLOCK_N = 64  # keys per step of the online softmax
_NUM_WARPS = 4
_NUM_STAGES = 2  # software pipelining of the K/V loads (changes no arithmetic)


@triton.jit(do_not_specialize=["num_seqs", "block_size", "stride_bt", "block_table_ptr", "query_start_ptr",
                               "seq_lens_ptr", "tile_seq_ptr", "tile_first_ptr"])
def _attention_kernel(
    q_ptr, o_ptr, k_ptr, v_ptr, block_table_ptr, query_start_ptr, seq_lens_ptr, tile_seq_ptr, tile_first_ptr,
    num_seqs, block_size, scale_log2,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    REP: tl.constexpr, REP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    g = tl.program_id(1)  # KV head
    s = tl.load(tile_seq_ptr + tile)
    if s >= num_seqs:  # the grid is an upper bound on the tiles
        return
    first = tl.load(tile_first_ptr + tile)  # the tile's first query token, counted within the sequence
    q0 = tl.load(query_start_ptr + s).to(tl.int64)
    n_q = tl.load(query_start_ptr + s + 1) - q0
    ctx = tl.load(seq_lens_ptr + s) - n_q  # keys cached before this call's tokens
    TOKENS: tl.constexpr = ROWS // REP_PAD

    rows = tl.arange(0, ROWS)
    tok = first + rows // REP_PAD
    head = g * REP + rows % REP_PAD
    row_ok = (tok < n_q) & (rows % REP_PAD < REP)
    pos = tl.where(row_ok, ctx + tok, 0)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    last = ctx + tl.minimum(first + TOKENS, n_q) - 1  # the tile's furthest position

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
    for start in range(0, last + 1, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos <= last
        block = tl.load(block_table_ptr + s * stride_bt + kpos // block_size, mask=k_ok, other=0).to(tl.int64)
        slot = kpos % block_size
        k = tl.load(k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + g * stride_kh + d[None, :],
                    mask=k_ok[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k)) * scale_log2
        scores = tl.where(kpos[None, :] <= pos[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # Only a row with no visible key yet (inconsistent metadata) has m_new = -inf: 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(scores - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + g * stride_vh + d[None, :],
                    mask=k_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def check_shape(*, heads: int, kv_heads: int, head_dim: int) -> None:
    """ValueError unless the kernel can take this attention shape (every Qwen3 size and SmolLM2's 9/3 heads of 64 can)."""
    if head_dim < 16 or head_dim != triton.next_power_of_2(head_dim) or heads % kv_heads:
        raise ValueError(f"model: batch-invariant attention on CUDA needs head_dim a power of two >= 16 and "
                         f"heads a multiple of kv_heads, got head_dim {head_dim}, {heads} / {kv_heads} heads")
    if triton.next_power_of_2(heads // kv_heads) > _ROWS:
        raise ValueError(f"model: batch-invariant attention on CUDA takes at most {_ROWS} query heads per KV "
                         f"head, got {heads} / {kv_heads}")


def _tokens_per_tile(heads: int, kv_heads: int) -> int:
    rep_pad = triton.next_power_of_2(heads // kv_heads)
    assert rep_pad <= _ROWS, "check_shape first"
    return _ROWS // rep_pad


def plan_tiles(query_start_loc: torch.Tensor, *, num_tokens: int, heads: int, kv_heads: int):
    """Each program's (sequence, first new token): tiles of a few tokens of one sequence.

    Device ops only. The grid is an upper bound known on the host (a tile
    holds at least one token); programs past the last tile see sequence
    ``num_seqs`` and return. One plan serves every layer of a forward.
    """
    per_tile = _tokens_per_tile(heads, kv_heads)
    num_seqs = query_start_loc.shape[0] - 1
    if num_seqs == 0:
        return query_start_loc[:0], query_start_loc[:0]
    n_q = query_start_loc[1:] - query_start_loc[:-1]
    tiles = (n_q + per_tile - 1) // per_tile
    ends = torch.cumsum(tiles, 0)
    index = torch.arange(min(num_tokens, num_seqs + num_tokens // per_tile), device=query_start_loc.device)
    tile_seq = torch.searchsorted(ends, index, right=True)
    begin = (ends - tiles)[tile_seq.clamp(max=num_seqs - 1)]
    return tile_seq, (index - begin) * per_tile


def attention(q_THD: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, *,
              block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              scale: float, tiles: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached keys, batch-invariantly.

    q_THD: [tokens, heads, head_dim], sequence s's new tokens at rows
    query_start_loc[s]:query_start_loc[s+1], the last of its seq_lens[s]
    positions. key_cache/value_cache: [blocks, block_size, kv_heads, head_dim]
    holding every position of every sequence, position p of sequence s in
    block block_table[s, p // block_size]. Query head h reads KV head
    h // (heads // kv_heads). ``tiles``: ``plan_tiles``' result, when several
    calls share it. Only device tensors are read: no host sync. Rows of no
    sequence (a CUDA graph's padding) are left unwritten.
    """
    T, H, D = q_THD.shape
    G = key_cache.shape[2]
    assert H % G == 0 and D == triton.next_power_of_2(D), "check_shape first"
    assert q_THD.dtype == key_cache.dtype == value_cache.dtype, "one dtype, so both sides run one tl.dot"
    assert key_cache.stride(3) == value_cache.stride(3) == 1
    if q_THD.stride(2) != 1:
        q_THD = q_THD.contiguous()
    num_seqs = query_start_loc.shape[0] - 1
    out = torch.empty_like(q_THD)
    if T == 0 or num_seqs == 0:
        return out
    tile_seq, tile_first = tiles or plan_tiles(query_start_loc, num_tokens=T, heads=H, kv_heads=G)
    # Triton specialises strides and pointers on divisibility by 16: the same
    # for every caller when these hold, so trainer and generator run one binary
    # (and its loads are 16 bytes wide).
    strides = (*q_THD.stride()[:2], *out.stride()[:2], *key_cache.stride()[:3], *value_cache.stride()[:3])
    assert all(st % 16 == 0 for st in strides), f"strides {strides} not multiples of 16"
    assert all(t.data_ptr() % 16 == 0 for t in (q_THD, out, key_cache, value_cache)), "tensors not 16-byte aligned"
    _attention_kernel[(tile_seq.shape[0], G)](
        q_THD, out, key_cache, value_cache, block_table, query_start_loc, seq_lens, tile_seq, tile_first,
        num_seqs, key_cache.shape[1], scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
        *strides, block_table.stride(0),
        REP=H // G, REP_PAD=triton.next_power_of_2(H // G), HEAD_DIM=D, ROWS=_ROWS, BLOCK_N=_BLOCK_N,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    return out


def contiguous_attention(q_BLHD: torch.Tensor, k_BLGD: torch.Tensor, v_BLGD: torch.Tensor, *,
                         scale: float) -> torch.Tensor:
    """The trainer's causal attention over full sequences with ``attention``'s kernel.

    Each sequence is one cache block of L positions, so the trainer and the
    generator run the same kernel on the same values.
    """
    B, L, H, D = q_BLHD.shape
    device = q_BLHD.device
    k, v = (t if t.stride(3) == 1 else t.contiguous() for t in (k_BLGD, v_BLGD))
    out = attention(
        q_BLHD.reshape(B * L, H, D), k, v,
        block_table=torch.arange(B, dtype=torch.int32, device=device)[:, None],
        query_start_loc=torch.arange(0, (B + 1) * L, L, dtype=torch.int32, device=device),
        seq_lens=torch.full((B,), L, dtype=torch.int32, device=device),
        scale=scale,
    )
    return out.view(B, L, H, D)
