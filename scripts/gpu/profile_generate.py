"""Where one GRPO generate's time goes, per engine variant: GPU busy fraction, engine steps per token, host
ms per iteration.

The loop's own batch (run_configs/qwen3_0.6b.toml: 64 prompts x 8 samples = 512 sequences, up to 256
tokens, T=1, the sampled token's logprob) through our Engine on random Qwen3-0.6B weights. Each variant
runs in its own process (its own engine): a warm-up generate, ``--repeats`` timed ones (tokens/s, engine
steps and model iterations counted, nothing synchronised), one under torch.profiler (kernel intervals ->
GPU busy time; time the host thread spent blocked in CUDA synchronisations -> host busy time), then the
in-place promise: one weight changed through the sync, and the same seeded prompts must sample other
tokens. JSON per variant is written as soon as it is done, so a call that runs out of time keeps what ran.

    python3 scripts/gpu/profile_generate.py [--variants base no_async compile dict_logprobs] [--out DIR]

Long contexts (issue 39: what an engine step costs when its attention reads thousands of tokens a sequence):
    python3 scripts/gpu/profile_generate.py --variants base fp8 --prompts 96 --n 1 --prompt-len 4000 \
        --max-tokens 256 --gpu-memory-utilization 0.8
(n 1: prompts of their own, so no sequence reads another's cached blocks; the prefill is in the profile, ~5% of
the attention's time at these sizes). Variants triton and fp8_triton run vLLM's Triton attention instead of
FlashAttention-3 (generator.attention_backend), whose fp8 path read at 56% of an H200's bandwidth (bf16: 90%).
The own-rank generator's batch (issue 39, layout d: a few hundred sequences of ~2k-token contexts, where an engine
step cost the same in bf16 and fp8), with and without generator.seeded_noise batched (variants batched, fp8_batched;
on 2026-11-29 the same samples digest as without: vLLM 0.26's model runner V2 samples every request in one kernel):
    python3 scripts/gpu/profile_generate.py --variants base batched fp8 fp8_batched --prompts 320 --n 1 \
        --prompt-len 2000 --max-tokens 256 --gpu-memory-utilization 0.8

Definitions (per generate, ``iterations`` = model executions with scheduled tokens):
- gpu_busy_fraction: union of kernel intervals / wall, under the profiler; gpu_busy_fraction_unprofiled
  is that kernel time over an unprofiled generate's wall (the profiler slows the host, not the GPU).
- host_ms_per_iteration: (profiled wall - host time blocked in cuda*Synchronize) / iterations: the engine
  thread's own work (scheduling, input preparation, launches, output processing), profiler overhead included;
  gpu_idle_ms_per_iteration_unprofiled: (unprofiled wall - GPU busy) / iterations, what the host costs the GPU.
- samples_digest / logprobs_digest: sha256 of the seeded generate's tokens / logprobs; variants that keep
  the kernels (base, no_async, dict_logprobs) must agree (compile changes the arithmetic).
- engine_steps_per_token: LLMEngine.step calls / max_tokens (every sample runs to max_tokens: random
  weights, no eos id); iterations_per_token likewise.
- kv_read_tb_per_s: the trace's KV cache reads over the loop's wall (gen_kv_read_tb_per_s, unprofiled);
  attention_s: the profiled generate's GPU time in attention kernels (names holding "attn", "attention", "flash"
  or "reduce_segments": FlashAttention's or the Triton backend's, their split-KV combines, vLLM's
  reshape_and_cache_flash that writes the cache),
  attention_share its part of all kernel time, attention_tb_per_s the KV reads over it: the attention kernel's
  own rate against the GPU's memory bandwidth (H100 3.35, H200 4.8 TB/s).
"""

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from profile_host import dict_logprobs  # noqa: E402

VARIANTS = {
    "base": {},
    "no_async": {"async_scheduling": False},
    "compile": {"compile": True},
    "compile_no_async": {"compile": True, "async_scheduling": False},
    "dict_logprobs": {},
    "seqs256": {"max_num_seqs": 256},
    "eager": {"enforce_eager": True},
    "fp8": {"kv_cache_dtype": "fp8"},
    "triton": {"attention_backend": "TRITON_ATTN"},
    "fp8_triton": {"kv_cache_dtype": "fp8", "attention_backend": "TRITON_ATTN"},
    "batched": {"seeded_noise": "batched"},
    "fp8_batched": {"kv_cache_dtype": "fp8", "seeded_noise": "batched"},
}
"""GeneratorConfig overrides per variant (base: the loop's config). dict_logprobs: base with vLLM's
per-token logprob dicts (flat_logprobs off), the host path before flat logprobs."""
ATTENTION_KERNELS = ("attn", "attention", "flash", "reduce_segments")
"""Parts of the attention kernels' names (FlashAttention-3's, vLLM's Triton unified attention and its combine)."""


def kernel_union_s(prof) -> tuple[float, float]:
    """(union of CUDA kernel/memcpy intervals, sum of their durations), seconds."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == DeviceType.CUDA)
    union, total, end = 0.0, 0.0, float("-inf")
    for a, b in spans:
        total += b - a
        if a > end:
            union += b - a
            end = b
        elif b > end:
            union += b - end
            end = b
    return union / 1e6, total / 1e6


def worker(variant: str, args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from torchtitan_rl.config import GeneratorConfig, ModelConfig, SamplingConfig, WeightSyncConfig
    from torchtitan_rl.engine import engine as engine_module
    from torchtitan_rl.engine.engine import Engine
    from torchtitan_rl.models.families import resolve_shape
    from torchtitan_rl.models.shape import build_titan_model
    from torchtitan_rl.weight_sync.sync import WeightSync

    cuda = args.device == "cuda"
    max_len = max(1024, args.prompt_len + args.max_tokens) if cuda else args.prompt_len + args.max_tokens
    shape = resolve_shape(flavor=args.flavor, hf_checkpoint=None, vocab_size=0 if cuda else 16, max_seq_len=max_len)
    titan = build_titan_model(shape, seed=0, device=args.device)
    config = GeneratorConfig(max_model_len=max_len, max_num_seqs=args.prompts * args.n, enforce_eager=False,
                             gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_gb=1.0)
    for key, value in VARIANTS[variant].items():
        setattr(config, key, value)
    config.check("generator")
    t = time.perf_counter()
    gen = Engine(config, model_config=ModelConfig(flavor=args.flavor), shape=shape, seed=0, device=args.device,
                 workdir=Path(tempfile.mkdtemp(prefix="prof_gen_")))
    build_s = time.perf_counter() - t
    state = {**dict(titan.named_parameters()), **dict(titan.named_buffers())}
    ws = WeightSync(WeightSyncConfig(), reference=state, generator=gen)
    ws.sync(state, version=1)
    if variant == "dict_logprobs":
        dict_logprobs(engine_module, gen.engine)
    rng = random.Random(0)
    prompts = [[rng.randrange(shape.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens)

    counts = {"engine_steps": 0, "iterations": 0}
    real_step = gen.engine.step
    core = gen.engine.engine_core.engine_core
    real_execute = core.model_executor.execute_model

    def counting_step():
        counts["engine_steps"] += 1
        return real_step()

    def counting_execute(scheduler_output, *a, **kw):
        counts["iterations"] += scheduler_output.total_num_scheduled_tokens > 0
        return real_execute(scheduler_output, *a, **kw)

    gen.engine.step, core.model_executor.execute_model = counting_step, counting_execute

    digests = {}

    def generate(seed: int = 1) -> tuple[float, int, dict, object]:
        counts.update(engine_steps=0, iterations=0)
        t = time.perf_counter()
        rollouts = gen.generate(prompts, n=args.n, sampling=sampling, seed=seed)
        wall = time.perf_counter() - t
        # The same seed and weights must sample the same tokens in every variant that keeps the kernels
        # (async scheduling on/off, dict logprobs): compare these across variants.
        digests.setdefault("samples_digest", hashlib.sha256(json.dumps(rollouts.completion_ids).encode()).hexdigest())
        digests.setdefault("logprobs_digest", hashlib.sha256(json.dumps(rollouts.logprobs).encode()).hexdigest())
        return wall, sum(len(c) for c in rollouts.completion_ids), dict(counts), rollouts.trace

    generate()  # warm-up
    runs = [generate() for _ in range(args.repeats)]
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        wall, tokens, prof_counts, prof_trace = generate()
    union_s, kernel_sum_s = kernel_union_s(prof)
    averages = prof.key_averages()
    blocked = sum(e.cpu_time_total for e in averages if "Synchronize" in e.key) / 1e6
    top = sorted((e for e in averages if e.self_device_time_total > 0),
                 key=lambda e: e.self_device_time_total, reverse=True)[:8]
    iterations = prof_counts["iterations"]
    attention_s = sum(e.self_device_time_total for e in averages
                      if any(part in e.key.lower() for part in ATTENTION_KERNELS)) / 1e6
    gen_s = statistics.median(r[0] for r in runs)

    # The in-place promise with this variant's graphs (and compile): one weight changed through the sync.
    few = prompts[:4]
    before = gen.generate(few, n=2, sampling=SamplingConfig(temperature=1.0, max_tokens=32), seed=5)
    with torch.no_grad():
        w = titan.layers["0"].feed_forward.w1.weight
        w.copy_(torch.randn_like(w) * w.std() * 3)
    ws.sync({**dict(titan.named_parameters()), **dict(titan.named_buffers())}, version=2)
    after = gen.generate(few, n=2, sampling=SamplingConfig(temperature=1.0, max_tokens=32), seed=5)

    return {
        "variant": variant, "overrides": VARIANTS[variant],
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "async_scheduling": gen.engine.vllm_config.scheduler_config.async_scheduling,
        "compiled": not getattr(gen.model, "do_not_compile", True),
        "engine_build_s": build_s,
        "generate_s": [r[0] for r in runs], "tokens": runs[0][1],
        "tokens_per_s": statistics.median(r[1] / r[0] for r in runs),
        "engine_steps": runs[0][2]["engine_steps"], "iterations": runs[0][2]["iterations"],
        "engine_steps_per_token": runs[0][2]["engine_steps"] / args.max_tokens,
        "iterations_per_token": runs[0][2]["iterations"] / args.max_tokens,
        "ms_per_iteration_unprofiled": 1e3 * gen_s / runs[0][2]["iterations"],
        "profiled_wall_s": wall,
        "gpu_busy_s": union_s, "gpu_kernel_sum_s": kernel_sum_s,
        "gpu_busy_fraction": union_s / wall,
        "gpu_busy_fraction_unprofiled": union_s / gen_s,
        "gpu_ms_per_iteration": 1e3 * union_s / iterations,
        # Unprofiled wall per iteration minus the GPU's: the GPU idle, waiting for the host.
        "gpu_idle_ms_per_iteration_unprofiled": 1e3 * (gen_s - union_s) / runs[0][2]["iterations"],
        "host_blocked_s": blocked,
        "host_ms_per_iteration": 1e3 * (wall - blocked) / iterations,
        "top_gpu_kernels": [(e.key[:80], round(e.self_device_time_total / 1e3, 1)) for e in top],
        "kv_read_tb_per_s": statistics.median(r[3].kv_read_rate for r in runs) / 1e12,
        "attention_s": attention_s, "attention_share": attention_s / kernel_sum_s if kernel_sum_s else 0.0,
        "attention_tb_per_s": prof_trace.kv_read_bytes / attention_s / 1e12 if attention_s else 0.0,
        **digests,
        "one_weight_change_changes_samples": before.completion_ids != after.completion_ids,
        "one_weight_change_changes_logprobs": before.logprobs != after.logprobs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["base", "no_async", "compile", "dict_logprobs"],
                        choices=list(VARIANTS))
    parser.add_argument("--flavor", default="0.6B")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (--flavor tiny)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="profile_generate.json goes here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        Path(args.worker_out).write_text(json.dumps(worker(args.worker, args)))
        os._exit(0)  # skip vLLM's in-process engine teardown
    out = Path(args.out) / "profile_generate.json"
    out.parent.mkdir(parents=True, exist_ok=True)  # before the first variant's minutes, not after them
    results = []
    passthrough = ["--flavor", args.flavor, "--device", args.device, "--prompts", str(args.prompts), "--n", str(args.n),
                   "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
                   "--repeats", str(args.repeats), "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.variants:
            worker_out = Path(tmp) / f"{variant}.json"
            t = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, *passthrough, "--worker", variant,
                                   "--worker-out", str(worker_out)])
            if proc.returncode == 0:
                results.append({**json.loads(worker_out.read_text()), "process_s": time.perf_counter() - t})
                r = results[-1]
                print(f"[profile_generate] {variant}: {r['tokens_per_s']:.0f} tokens/s, GPU busy "
                      f"{r['gpu_busy_fraction_unprofiled']:.0%} (profiled {r['gpu_busy_fraction']:.0%}), "
                      f"{r['engine_steps_per_token']:.2f} engine steps/token, host {r['host_ms_per_iteration']:.1f} "
                      f"ms/iteration, GPU {r['gpu_ms_per_iteration']:.1f} ms/iteration, KV reads "
                      f"{r['kv_read_tb_per_s']:.2f} TB/s (attention kernels {r['attention_tb_per_s']:.2f} TB/s, "
                      f"{r['attention_share']:.0%} of kernel time), "
                      f"one-weight change seen: {r['one_weight_change_changes_logprobs']}", flush=True)
            else:
                results.append({"variant": variant, "exit": proc.returncode})
                print(f"[profile_generate] {variant}: exit {proc.returncode}", flush=True)
            out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
