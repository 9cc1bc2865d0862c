"""Generation throughput: our generator vs vLLM's native Qwen3, same weights and settings.

Ours: torchtitan's Qwen3 registered in vLLM (Engine, weights by the sync).
Native: vLLM's Qwen3ForCausalLM (its fused kernels and torch.compile), loaded
with the same weights through its load_weights. Same engine settings, same
random prompts, one request per sample, T=1, every sample runs to max_tokens
(random weights and no eos id). Each engine runs in its own process.

    python scripts/bench_generation.py --flavor 0.6B --modes graphs eager
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import table, write_section  # noqa: E402


def worker(args) -> dict:
    import torch

    from torchtitan_rl import compat
    from torchtitan_rl.config import GeneratorConfig, ModelConfig, SamplingConfig, WeightSyncConfig
    from torchtitan_rl.engine.engine import build_engine
    from torchtitan_rl.models.families import resolve_shape, to_hf
    from torchtitan_rl.models.shape import build_titan_model

    shape = resolve_shape(flavor=args.flavor, hf_checkpoint=None, vocab_size=0, max_seq_len=args.max_model_len)
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    titan = build_titan_model(shape, seed=0, device=dev)
    rng = random.Random(0)
    prompts = [[rng.randrange(shape.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    eager = args.worker_mode == "eager"
    workdir = Path(tempfile.mkdtemp(prefix="bench_gen_"))
    t = time.perf_counter()
    if args.worker_engine == "ours":
        from torchtitan_rl.engine.engine import Engine
        from torchtitan_rl.weight_sync.sync import WeightSync

        gen = Engine(
            GeneratorConfig(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                            enforce_eager=eager, gpu_memory_utilization=args.gpu_memory_utilization),
            model_config=ModelConfig(flavor=args.flavor), shape=shape, seed=0, device=dev, workdir=workdir,
        )
        build_s = time.perf_counter() - t
        state = {**dict(titan.named_parameters()), **dict(titan.named_buffers())}
        WeightSync(WeightSyncConfig(), reference=state, generator=gen).sync(state, version=1)
        sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens)

        def generate() -> list[list[int]]:
            return gen.generate(prompts, n=1, sampling=sampling).completion_ids
    else:
        from vllm import SamplingParams

        (workdir / "config.json").write_text(
            json.dumps(shape.to_hf_config())
        )
        engine = build_engine(
            model=str(workdir), load_format="dummy", dtype="bfloat16", max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, enforce_eager=eager, tensor_parallel_size=1, seed=0,
            device=dev, gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=1 << 30,
            batch_invariant=False,
        )
        build_s = time.perf_counter() - t
        hf_state = to_hf(titan.state_dict(), shape)
        with torch.no_grad():
            compat.vllm_model(engine).load_weights((k, v.bfloat16()) for k, v in hf_state.items())
        params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, logprobs=0, ignore_eos=True)
        counter = iter(range(10**9))

        def generate() -> list[list[int]]:
            # As Engine.generate: one request per sample, step until done.
            ids = []
            for p in prompts:
                rid = f"r{next(counter)}"
                engine.add_request(rid, {"prompt_token_ids": p}, params)
                ids.append(rid)
            done = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = list(out.outputs[0].token_ids)
            return [done[r] for r in ids]

    del titan
    if dev == "cuda":
        torch.cuda.empty_cache()
    generate()  # warm-up
    runs = []
    for _ in range(args.repeats):
        sync()
        t = time.perf_counter()
        ids = generate()
        sync()
        runs.append((time.perf_counter() - t, sum(len(c) for c in ids)))
    lengths = sorted({len(c) for c in ids})
    return {"build_s": build_s, "runs": runs, "completion_lengths": lengths[:5]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="0.6B")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["graphs"], choices=["graphs", "eager"])
    parser.add_argument("--json", default=None, help="also write the raw results here")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    parser.add_argument("--worker-engine", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-mode", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_engine:
        res = worker(args)
        Path(args.worker_out).write_text(json.dumps(res))
        print(json.dumps(res), flush=True)
        os._exit(0)  # skip vLLM's in-process engine teardown

    results = {}
    passthrough = [
        "--flavor", args.flavor, "--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len),
        "--max-tokens", str(args.max_tokens), "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs), "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--repeats", str(args.repeats), "--device", args.device,
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            for engine in ("ours", "native"):
                out = Path(tmp) / f"{engine}_{mode}.json"
                cmd = [sys.executable, __file__, *passthrough, "--worker-engine", engine,
                       "--worker-mode", mode, "--worker-out", str(out)]
                t = time.perf_counter()
                proc = subprocess.run(cmd)
                print(f"[bench_generation] {engine}/{mode}: exit {proc.returncode} in "
                      f"{time.perf_counter() - t:.0f} s", flush=True)
                if proc.returncode == 0:
                    results[(engine, mode)] = json.loads(out.read_text())
    if args.json:
        Path(args.json).write_text(json.dumps({f"{e}/{m}": r for (e, m), r in results.items()}, indent=1))

    def tok_s(res: dict) -> float:
        rates = sorted(n / t for t, n in res["runs"])
        return rates[len(rates) // 2]

    rows = []
    for mode in args.modes:
        native = results.get(("native", mode))
        for engine in ("ours", "native"):
            res = results.get((engine, mode))
            if res is None:
                rows.append([engine, mode, "failed", "", "", ""])
                continue
            ratio = f"{tok_s(res) / tok_s(native):.2f}x" if native else ""
            rows.append([engine, mode, f"{tok_s(res):,.0f}", ratio, f"{res['build_s']:.1f}",
                         ",".join(map(str, res["completion_lengths"]))])
    body = (
        f"Qwen3-{args.flavor} shape, random weights (identical in both engines), {args.num_prompts} prompts x "
        f"{args.prompt_len} random ids -> {args.max_tokens} new tokens each, T=1, logprobs of the sampled "
        f"token returned, max_num_seqs={args.max_num_seqs}, gpu_memory_utilization="
        f"{args.gpu_memory_utilization}; median of {args.repeats} runs after one warm-up. ours = Engine "
        f"(torchtitan's Qwen3 in vLLM; with graphs: vLLM's full CUDA graphs, no torch.compile, since the "
        f"model is not a vLLM-compiled class); native = vLLM's Qwen3ForCausalLM (graphs: torch.compile + "
        f"piecewise/full CUDA graphs, vLLM's default).\n\n"
        + table(["engine", "mode", "tokens/s", "vs native", "engine build s", "completion lengths"], rows)
    )
    write_section(f"Generation throughput ({args.device}, Qwen3-{args.flavor})", device=args.device, body=body)


if __name__ == "__main__":
    main()
