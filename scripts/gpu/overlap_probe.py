"""Can a decode and a training step share one GPU? The question behind layout e (generator.overlap_training).

    python3 scripts/gpu/overlap_probe.py [--out DIR]      # one GPU, torch only, about a minute

Two loops stand in for the two threads of a colocated run with generator.overlap_training:
- decode: per step, one decode-shaped attention a layer (a query row per sequence reading its KV: memory-bound, as
  the long tail's engine step, docs/benchmarks.md "The long tail"), then the host waits for the step (as vLLM's loop
  waits for its sampled tokens);
- train: bf16 matrix multiplies of a training step's size, launched back to back (compute-bound).
Each runs alone, then both at once in two threads on two streams, the decode's stream at the default priority,
then at the highest, then so with the training loop as CUDA graph replays (few launches: what is left of the
slowdown is the GPU's, not the interpreter's). Printed and written (DIR/overlap_probe.json): each loop's seconds, the
decode's slowdown beside training, and the pair's wall against the two run in turn (below 1: they overlapped).
"""

import argparse
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.nn.functional as F

LAYERS = 28
"""Attention calls a decode step (Qwen3-0.6B's layers)."""
BATCH, KV_HEADS, CONTEXT, HEAD_DIM = 256, 8, 2048, 128
"""A decode step's shape: 256 sequences of 2k-token contexts (~30 GB of KV a step over 28 layers, as layout a's
wave early in a generate); a query head per KV head (grouped queries read the same bytes)."""
GEMM = 8192
"""Side of the training loop's square bf16 matrix multiplies (~1.1 TFLOP each)."""
GRAPHED = 100
"""Multiplies a CUDA graph holds in the graphed variant."""


def decode(steps: int, stream: torch.cuda.Stream, q, k, v) -> float:
    with torch.cuda.stream(stream):
        started = time.perf_counter()
        for _ in range(steps):
            for _ in range(LAYERS):
                F.scaled_dot_product_attention(q, k, v)
            stream.synchronize()  # the engine waits for each step's tokens
        return time.perf_counter() - started


def train(steps: int, stream: torch.cuda.Stream, a, b, graph: torch.cuda.CUDAGraph | None = None) -> float:
    """``steps`` multiplies, one launch each from Python, or with ``graph`` (GRAPHED of them captured) a launch per
    GRAPHED: the interpreter then barely runs, which separates its share from the GPU's."""
    with torch.cuda.stream(stream):
        started = time.perf_counter()
        for _ in range(steps // GRAPHED if graph else steps):
            graph.replay() if graph else a @ b
        stream.synchronize()
        return time.perf_counter() - started


def graphed(a, b) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a @ b  # the matmul's workspace, before capture
        with torch.cuda.graph(graph):
            for _ in range(GRAPHED):
                a @ b
    torch.cuda.synchronize()
    return graph


def together(decode_steps: int, train_steps: int, *, priority: int, tensors: dict, graph=None) -> dict:
    """Both loops at once, each in its own thread and stream; seconds of each and of the pair."""
    decode_stream = torch.cuda.Stream(priority=priority)
    train_stream = torch.cuda.Stream()
    times = {}

    def run(name, fn, *args):
        times[name] = fn(*args)

    threads = [threading.Thread(target=run, args=("decode", decode, decode_steps, decode_stream, *tensors["qkv"])),
               threading.Thread(target=run, args=("train", train, train_steps, train_stream, *tensors["ab"], graph))]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    times["wall"] = time.perf_counter() - started
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--decode-steps", type=int, default=400)
    parser.add_argument("--train-steps", type=int, default=3000)
    args = parser.parse_args()
    dev = torch.device("cuda")
    bf16 = dict(device=dev, dtype=torch.bfloat16)
    kv_shape = (BATCH, KV_HEADS, CONTEXT, HEAD_DIM)
    tensors = {
        "qkv": (torch.randn(BATCH, KV_HEADS, 1, HEAD_DIM, **bf16), torch.randn(kv_shape, **bf16),
                torch.randn(kv_shape, **bf16)),
        "ab": (torch.randn(GEMM, GEMM, **bf16), torch.randn(GEMM, GEMM, **bf16)),
    }
    stream = torch.cuda.Stream()
    decode(5, stream, *tensors["qkv"])  # warm-up: kernels picked and loaded
    train(5, stream, *tensors["ab"])
    alone_decode = decode(args.decode_steps, stream, *tensors["qkv"])
    alone_train = train(args.train_steps, stream, *tensors["ab"])
    kv_bytes = 2 * LAYERS * BATCH * KV_HEADS * CONTEXT * HEAD_DIM * 2
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
        "decode_alone_s": alone_decode, "train_alone_s": alone_train,
        "decode_step_ms": 1e3 * alone_decode / args.decode_steps,
        "decode_kv_tb_per_s": kv_bytes * args.decode_steps / alone_decode / 1e12,
        "train_tflops": 2 * GEMM**3 * args.train_steps / alone_train / 1e12,
    }
    graph = graphed(*tensors["ab"])
    for name, priority, g in (("default", 0, None), ("high", -1, None), ("high_graphed", -1, graph)):
        t = together(args.decode_steps, args.train_steps, priority=priority, tensors=tensors, graph=g)
        result[f"{name}_priority"] = {
            **{f"{k}_s": v for k, v in t.items()},
            "decode_slowdown": t["decode"] / alone_decode,
            "wall_over_in_turn": t["wall"] / (alone_decode + alone_train),
        }
    print(json.dumps(result, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overlap_probe.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
