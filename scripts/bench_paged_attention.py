"""Batch-invariant attention kernel (kernels/paged_attention.py) vs FlashAttention, CUDA.

Times our kernel on the generator's decode step (one new token per sequence
over vLLM-style paged K/V) and on the trainer's full sequences, against the
kernels default mode runs there in the same process: vLLM's FA3 on the paged
cache (its own split heuristic, and num_splits=1 as vLLM's batch-invariant
mode runs it) and torch's SDPA (what torchtitan's trainer calls). With
--sweep it tries tile configs (query rows, key block, warps, stages); a
config only counts if the decode rows are bitwise the trainer's rows (both
sides must run one config). The module's current config is marked.

    python scripts/bench_paged_attention.py --sweep
"""

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import median_seconds, table, write_section  # noqa: E402

from torchtitan_rl.kernels import paged_attention as pa  # noqa: E402

CONFIG = ("_ROWS", "_BLOCK_N", "_NUM_WARPS", "_NUM_STAGES")


def per_call_s(fn, *, calls: int = 20, repeats: int = 7) -> float:
    """Median GPU time of one call: ``calls`` calls captured in a CUDA graph, replayed.

    The generator's decode steps replay CUDA graphs, so host launch costs are
    not what they pay; ``eager_call_s`` measures those.
    """
    fn()  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return median_seconds(graph.replay, device="cuda", repeats=repeats) / calls


def eager_call_s(fn, *, calls: int = 20, repeats: int = 7) -> float:
    """Median wall time of one call launched eagerly, back to back (host cost included)."""
    return median_seconds(lambda: [fn() for _ in range(calls)], device="cuda", repeats=repeats) / calls


def workload(*, seqs: int, train_seqs: int, seq_len: int, heads: int, kv_heads: int, head_dim: int,
             block_size: int = 16):
    g = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *s: torch.randn(*s, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    q_BLHD, k_BLGD, v_BLGD = randn(seqs, seq_len, heads, head_dim), *(randn(seqs, seq_len, kv_heads, head_dim)
                                                                     for _ in range(2))
    # The same K/V in a paged cache, blocks shuffled as vLLM hands them out.
    per_seq = -(-seq_len // block_size)
    table_SB = torch.randperm(seqs * per_seq, device="cuda", generator=g).view(seqs, per_seq).to(torch.int32)
    caches = []
    for t in (k_BLGD, v_BLGD):
        cache = torch.zeros(seqs * per_seq, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        padded = torch.zeros(seqs, per_seq * block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        padded[:, :seq_len] = t
        cache[table_SB.long()] = padded.view(seqs, per_seq, block_size, kv_heads, head_dim)
        caches.append(cache)
    return dict(q_BLHD=q_BLHD, k_BLGD=k_BLGD, v_BLGD=v_BLGD, caches=caches, table_SB=table_SB,
                train_seqs=train_seqs, scale=head_dim**-0.5)


def run_ours(w) -> dict:
    """Decode and trainer times of the module's current config, and whether their rows agree bitwise."""
    q_BLHD, scale = w["q_BLHD"], w["scale"]
    seqs, seq_len, heads, _ = q_BLHD.shape
    q_SHD = q_BLHD[:, -1].contiguous()  # each sequence's last token, decoded
    qsl = torch.arange(seqs + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((seqs,), seq_len, device="cuda", dtype=torch.int32)
    tiles = pa.plan_tiles(qsl, num_tokens=seqs, heads=heads, kv_heads=w["k_BLGD"].shape[2])  # once per forward

    def decode():
        return pa.attention(q_SHD, *w["caches"], block_table=w["table_SB"], query_start_loc=qsl, seq_lens=lens,
                            scale=scale, tiles=tiles)

    n = w["train_seqs"]
    train = lambda: pa.contiguous_attention(q_BLHD[:n], w["k_BLGD"][:n], w["v_BLGD"][:n], scale=scale)  # noqa: E731
    same = torch.equal(decode()[:n], train()[:, -1])
    return dict(decode_s=per_call_s(decode), train_s=per_call_s(train), bitwise=same,
                decode_eager_s=eager_call_s(decode), train_eager_s=eager_call_s(train))


def run_anchors(w) -> dict:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    q_BLHD, scale = w["q_BLHD"], w["scale"]
    seqs, seq_len, heads, _ = q_BLHD.shape
    q_SHD = q_BLHD[:, -1].contiguous()
    cu_q = torch.arange(seqs + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((seqs,), seq_len, device="cuda", dtype=torch.int32)

    def fa3(num_splits: int):
        return lambda: flash_attn_varlen_func(
            q_SHD, *w["caches"], max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=seq_len, seqused_k=lens,
            softmax_scale=scale, causal=True, block_table=w["table_SB"], num_splits=num_splits, fa_version=3)

    n = w["train_seqs"]
    q, k, v = (t[:n].transpose(1, 2) for t in (q_BLHD, w["k_BLGD"], w["v_BLGD"]))
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)  # noqa: E731
    return dict(fa3_s=per_call_s(fa3(0)), fa3_one_split_s=per_call_s(fa3(1)), sdpa_s=per_call_s(sdpa))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seqs", type=int, default=128, help="sequences decoding one token each")
    parser.add_argument("--train-seqs", type=int, default=32, help="sequences in the trainer's call")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--sweep", action="store_true", help="try tile configs too")
    parser.add_argument("--no-write", action="store_true", help="print only, leave docs/benchmarks.md")
    args = parser.parse_args()
    w = workload(seqs=args.seqs, train_seqs=args.train_seqs, seq_len=args.seq_len, heads=args.heads,
                 kv_heads=args.kv_heads, head_dim=args.head_dim)
    anchors = run_anchors(w)
    current = tuple(getattr(pa, name) for name in CONFIG)
    configs = [current]
    if args.sweep:
        configs += [c for c in itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (1, 2, 3)) if c != current]
    rows = []
    for config in configs:
        for name, value in zip(CONFIG, config):
            setattr(pa, name, value)
        try:
            r = run_ours(w)
        except Exception as e:  # a tile config past the GPU's shared memory fails to compile
            print(f"[bench_paged_attention] {config}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            continue
        rows.append((config, r))
        print(f"[bench_paged_attention] {config}: decode {r['decode_s'] * 1e6:.1f} us "
              f"(eager {r['decode_eager_s'] * 1e6:.1f}), train {r['train_s'] * 1e6:.1f} us "
              f"(eager {r['train_eager_s'] * 1e6:.1f}), bitwise {r['bitwise']}", flush=True)
    for name, value in zip(CONFIG, current):
        setattr(pa, name, value)
    rows.sort(key=lambda cr: (not cr[1]["bitwise"], max(cr[1]["decode_s"] / anchors["fa3_s"],
                                                          cr[1]["train_s"] / anchors["sdpa_s"])))
    us = lambda s: f"{s * 1e6:.1f}"  # noqa: E731
    body = table(
        ["rows, key block, warps, stages", "decode us", "/ FA3", "/ FA3 1 split", "trainer us", "/ SDPA",
         "decode == trainer bits"],
        [[", ".join(map(str, c)) + (" (current)" if c == current else ""), us(r["decode_s"]),
          f"{r['decode_s'] / anchors['fa3_s']:.2f}x", f"{r['decode_s'] / anchors['fa3_one_split_s']:.2f}x",
          us(r["train_s"]), f"{r['train_s'] / anchors['sdpa_s']:.2f}x", "yes" if r["bitwise"] else "NO"]
         for c, r in rows[:12] + [cr for cr in rows[12:] if cr[0] == current]],
    )
    r = dict(rows).get(current)
    body += (
        "\nGPU time per call (calls captured in a CUDA graph and replayed)."
        + (f" Eager launches, host cost included, of the current config: decode {us(r['decode_eager_s'])} us, "
           f"trainer {us(r['train_eager_s'])} us." if r else " The current config failed (see the log).")
        + f"\nAnchors, same run: FA3 on the paged cache {us(anchors['fa3_s'])} us (its split heuristic), "
        f"{us(anchors['fa3_one_split_s'])} us (num_splits=1, vLLM's batch-invariant mode); torch SDPA "
        f"{us(anchors['sdpa_s'])} us. Decode: {args.seqs} sequences x 1 new token at position "
        f"{args.seq_len - 1}, block size 16; trainer: {args.train_seqs} x {args.seq_len} tokens, causal; "
        f"{args.heads} query / {args.kv_heads} KV heads x {args.head_dim}, bf16. Sorted by the worse of the "
        f"two ratios{'; best 12 of ' + str(len(rows)) + ' configs shown' if len(rows) > 12 else ''}.\n"
    )
    print(body)
    if not args.no_write:
        write_section(f"Batch-invariant attention kernel ({args.seq_len} tokens, cuda)", device="cuda", body=body)


if __name__ == "__main__":
    main()
