"""What bounds one GRPO generate: decode iterations, host vs GPU time per iteration, a few engine settings.

The loop's own batch (run_configs/qwen3_0.6b.toml: 64 prompts x 8 samples -> up to 256 tokens, T=1, the
sampled token's logprob) through our Generator on random Qwen3 weights, timed per engine.step; one
generate under torch.profiler splits each iteration into GPU kernel time and the rest (host: scheduling,
sampling bookkeeping, output processing). Each setting runs in its own process (its own engine).

    python3 scripts/gpu/profile_generate.py [--settings base seqs256 eager] [--json out.json]
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "base": {},
    "seqs256": {"max_num_seqs": 256},
    "eager": {"enforce_eager": True},
}
"""GeneratorConfig overrides per setting (base: the loop's config)."""


def worker(setting: str, args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from torchtitan_rl.config import GeneratorConfig, ModelConfig, SamplingConfig, WeightSyncConfig
    from torchtitan_rl.engine.generator import Generator
    from torchtitan_rl.models.families import resolve_shape
    from torchtitan_rl.models.shape import build_titan_model
    from torchtitan_rl.weight_sync.sync import WeightSync

    shape = resolve_shape(flavor="0.6B", hf_checkpoint=None, vocab_size=0, max_seq_len=1024)
    titan = build_titan_model(shape, seed=0, device="cuda")
    config = GeneratorConfig(max_model_len=1024, max_num_seqs=512, enforce_eager=False, gpu_memory_utilization=0.5)
    for key, value in SETTINGS[setting].items():
        setattr(config, key, value)
    gen = Generator(config, model_config=ModelConfig(flavor="0.6B"), shape=shape, seed=0, device="cuda",
                    workdir=Path(tempfile.mkdtemp(prefix="prof_gen_")))
    state = {**dict(titan.named_parameters()), **dict(titan.named_buffers())}
    WeightSync(WeightSyncConfig(), reference=state, generator=gen).sync(state, version=1)
    del titan, state
    torch.cuda.empty_cache()
    rng = random.Random(0)
    prompts = [[rng.randrange(shape.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens)

    iteration_s: list[float] = []  # wall time of each engine.step (one decode iteration, or a prefill)
    real_step = gen.engine.step

    def timed_step():
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = real_step()
        torch.cuda.synchronize()
        iteration_s.append(time.perf_counter() - t)
        return out

    def generate() -> tuple[float, int]:
        t = time.perf_counter()
        rollouts = gen.generate(prompts, n=args.n, sampling=sampling, seed=1)
        return time.perf_counter() - t, sum(len(c) for c in rollouts.completion_ids)

    generate()  # warm-up
    runs = [generate() for _ in range(args.repeats)]
    gen.engine.step = timed_step
    generate()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall, tokens = generate()
    gen.engine.step = real_step
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages() if e.self_device_time_total > 0)
    top = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)[:8]
    return {
        "setting": setting, "overrides": SETTINGS[setting],
        "generate_s": [r[0] for r in runs], "tokens": runs[0][1],
        "tokens_per_s": statistics.median(n / t for t, n in runs),
        "decode_iterations": len(iteration_s),
        "iterations_per_s": len(iteration_s) / sum(iteration_s),
        "iteration_ms_median": 1e3 * statistics.median(iteration_s),
        "iteration_ms_first": 1e3 * iteration_s[0],
        "profiled_wall_s": wall,
        "gpu_kernel_s": gpu_us / 1e6,
        "gpu_busy_fraction": gpu_us / 1e6 / wall,
        "top_gpu_kernels": [(e.key[:80], round(e.self_device_time_total / 1e3, 1)) for e in top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=["base", "seqs256"], choices=list(SETTINGS))
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(worker(args.worker, args)))
        os._exit(0)  # skip vLLM's in-process engine teardown
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for setting in args.settings:
            out = Path(tmp) / f"{setting}.json"
            passthrough = ["--prompts", str(args.prompts), "--n", str(args.n), "--prompt-len", str(args.prompt_len),
                           "--max-tokens", str(args.max_tokens), "--repeats", str(args.repeats)]
            proc = subprocess.run([sys.executable, __file__, *passthrough, "--worker", setting,
                                   "--worker-out", str(out)])
            if proc.returncode == 0:
                results.append(json.loads(out.read_text()))
                print(json.dumps(results[-1], indent=1), flush=True)
            else:
                print(f"[profile_generate] {setting}: exit {proc.returncode}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
