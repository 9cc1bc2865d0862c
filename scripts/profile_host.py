"""Host work of one generate on a real CPU engine, per engine iteration and per token, by component.

Many short requests through our Engine (tiny Qwen3 unless --flavor), each component of vLLM's engine
loop timed where it is called (the scheduler's schedule and update_from_output, the output processor, the
model runner's execute_model and sample_tokens, which hold the model's forward and the sampler), plus our
own code around the loop. --cprofile prints cProfile's top functions of one more generate.

    python scripts/profile_host.py [--prompts 64 --n 8 --max-tokens 32] [--dict-logprobs] [--no-async] [--compile]
"""

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path


def timed(obj, name: str, totals: dict, key: str) -> None:
    """Replace ``obj.name`` by a wrapper adding its wall time to ``totals[key]`` and this thread's CPU time
    to ``totals[key + " cpu"]`` (the host components are one Python thread: their CPU time holds on a
    machine whose other processes take the cores, their wall time does not)."""
    real = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t
            totals[key + " cpu"] += time.thread_time() - c

    setattr(obj, name, wrapper)


def dict_logprobs(engine_module, engine) -> None:
    """The old path: vLLM's per-token logprob dicts (flat_logprobs off), turned into the flat lists that
    generate reads when each request finishes (as the old generate read the dicts once, at the end)."""
    from vllm.logprobs import FlatLogprobs

    real_params, real_step = engine_module.sampling_params, engine.step

    def params(*a, **kw):
        p = real_params(*a, **kw)
        p.flat_logprobs = False
        return p

    def step():
        outputs = real_step()
        for out in outputs:
            for c in out.outputs if out.finished else ():
                flat = FlatLogprobs()
                flat.extend(c.logprobs)
                c.logprobs = flat
        return outputs

    engine_module.sampling_params, engine.step = params, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavor", default="tiny")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dict-logprobs", action="store_true", help="vLLM's per-token logprob dicts (the old path)")
    parser.add_argument("--no-async", action="store_true", help="generator.async_scheduling = false")
    parser.add_argument("--compile", action="store_true", help="generator.compile = true (vLLM compiles the model)")
    parser.add_argument("--cprofile", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from torchtitan_rl.config import GeneratorConfig, ModelConfig, SamplingConfig, WeightSyncConfig
    from torchtitan_rl.engine import engine as engine_module
    from torchtitan_rl.engine.engine import Engine
    from torchtitan_rl.models.families import resolve_shape
    from torchtitan_rl.models.shape import build_titan_model
    from torchtitan_rl.weight_sync.sync import WeightSync

    max_len = args.prompt_len + args.max_tokens
    shape = resolve_shape(flavor=args.flavor, hf_checkpoint=None, vocab_size=16 if args.flavor == "tiny" else 0,
                          max_seq_len=max_len)
    config = GeneratorConfig(max_model_len=max_len, max_num_seqs=args.prompts * args.n, kv_cache_memory_gb=1.0,
                             async_scheduling=not args.no_async, compile=args.compile, enforce_eager=not args.compile)
    gen = Engine(config, model_config=ModelConfig(flavor=args.flavor), shape=shape, seed=0, device="cpu",
                 workdir=Path(tempfile.mkdtemp(prefix="prof_host_")))
    titan = build_titan_model(shape, seed=0)
    state = {**dict(titan.named_parameters()), **dict(titan.named_buffers())}
    WeightSync(WeightSyncConfig(), reference=state, generator=gen).sync(state, version=1)
    if args.dict_logprobs:
        dict_logprobs(engine_module, gen.engine)
    rng = random.Random(0)
    vocab = shape.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens)

    totals: dict[str, float] = defaultdict(float)
    core = gen.engine.engine_core.engine_core
    timed(core.scheduler, "schedule", totals, "scheduler.schedule")
    timed(core.scheduler, "update_from_output", totals, "scheduler.update_from_output")
    timed(core.model_executor, "execute_model", totals, "model_runner.execute_model (forward)")
    timed(core.model_executor, "sample_tokens", totals, "model_runner.sample_tokens (sampler)")
    timed(gen.engine.output_processor, "process_outputs", totals, "output_processor.process_outputs")
    timed(gen.engine, "add_request", totals, "engine.add_request")
    runner = core.model_executor.driver_worker.worker.model_runner
    for name in ("_update_states", "_prepare_inputs", "_bookkeeping_sync", "_model_forward"):
        timed(runner, name, totals, f"model_runner.{name}")
    iterations = [0]
    real_execute = core.model_executor.execute_model

    def counting_execute(scheduler_output, *a, **kw):
        iterations[0] += scheduler_output.total_num_scheduled_tokens > 0
        return real_execute(scheduler_output, *a, **kw)

    core.model_executor.execute_model = counting_execute
    steps = [0]
    timed(gen.engine, "step", totals, "engine.step")
    real_step = gen.engine.step

    def counting_step():
        steps[0] += 1
        return real_step()

    gen.engine.step = counting_step

    gen.generate(prompts, n=args.n, sampling=sampling, seed=1)  # warm-up
    runs = []
    host_parts = ["scheduler.schedule", "scheduler.update_from_output", "output_processor.process_outputs",
                  "engine.add_request", "model_runner._update_states", "model_runner._prepare_inputs",
                  "model_runner._bookkeeping_sync"]
    for _ in range(args.repeats):
        totals.clear()
        iterations[0] = steps[0] = 0
        t, c = time.perf_counter(), time.thread_time()
        rollouts = gen.generate(prompts, n=args.n, sampling=sampling, seed=1)
        wall, cpu = time.perf_counter() - t, time.thread_time() - c
        tokens = sum(len(c) for c in rollouts.completion_ids)
        # Our own code: generate's CPU time outside engine.step (requests in, rollouts out).
        ours = cpu - totals["engine.step cpu"] - totals["engine.add_request cpu"]
        host = sum(totals[k + " cpu"] for k in host_parts) + ours
        runs.append({
            "wall_s": wall, "tokens": tokens, "iterations": iterations[0], "engine_steps": steps[0],
            "host_cpu_ms_per_iteration": 1e3 * host / iterations[0],
            "host_cpu_us_per_token": 1e6 * host / tokens,
            "generate_outside_engine_cpu_ms": 1e3 * ours,
            "cpu_ms_per_iteration": {k: round(1e3 * totals[k + " cpu"] / iterations[0], 3) for k in host_parts},
            "wall_ms_per_iteration": {k: round(1e3 * v / iterations[0], 3) for k, v in sorted(totals.items())
                                      if not k.endswith(" cpu")},
        })
    best = min(runs, key=lambda r: r["host_cpu_ms_per_iteration"])
    result = {"flavor": args.flavor, "requests": args.prompts * args.n, "max_tokens": args.max_tokens,
              "async_scheduling": gen.engine.vllm_config.scheduler_config.async_scheduling,
              "flat_logprobs": not args.dict_logprobs, "compile": args.compile,
              "host_cpu_ms_per_iteration_runs": [round(r["host_cpu_ms_per_iteration"], 3) for r in runs],
              "host_cpu_ms_per_iteration_median": statistics.median(r["host_cpu_ms_per_iteration"] for r in runs),
              "best_run": best}
    print(json.dumps(result, indent=1))
    if args.cprofile:
        prof = cProfile.Profile()
        prof.enable()
        gen.generate(prompts, n=args.n, sampling=sampling, seed=1)
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
