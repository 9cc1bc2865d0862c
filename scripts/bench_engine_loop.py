"""Host time per engine step of Engine.generate on CPU, this checkout against an older one (issue 41).

A tiny Qwen3 (vocab 16) and many sequences (512 at once, max_num_seqs 512, enforce_eager), so the forward is small
and the step loop's host work shows: per generate, wall seconds per engine step, the part of it spent outside
``LLMEngine.step`` (our loop: the trace, the partial-rollout checks, the hooks) and the Python cycle collections
during the generate. ``--before DIR`` runs the same worker in a subprocess with DIR (a git worktree of an older
commit, e.g. 3a2b0a6) first on its PYTHONPATH, alternating which goes first, so both are measured on one machine
in one session. Also times compat.scheduler_load and TraceRecorder.iteration alone at 512 running requests.

    git -C . worktree add --detach /tmp/before 3a2b0a6
    python scripts/bench_engine_loop.py --before /tmp/before [--sequences 512 --max-tokens 64 --repeats 3] [--write]
"""

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import table, write_section  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def build(sequences: int, max_tokens: int, prompt_len: int):
    """A synced tiny CPU Engine with room for ``sequences`` at once (only APIs the older checkouts have too)."""
    from torchtitan_rl.config import GeneratorConfig, ModelConfig, WeightSyncConfig
    from torchtitan_rl.engine.engine import Engine
    from torchtitan_rl.models.families import resolve_shape
    from torchtitan_rl.models.shape import build_titan_model
    from torchtitan_rl.weight_sync.sync import WeightSync

    max_len = prompt_len + max_tokens
    shape = resolve_shape(flavor="tiny", hf_checkpoint=None, vocab_size=16, max_seq_len=max_len)
    config = GeneratorConfig(max_model_len=max_len, max_num_seqs=sequences, kv_cache_memory_gb=1.0,
                             enforce_eager=True)
    gen = Engine(config, model_config=ModelConfig(flavor="tiny"), shape=shape, seed=0, device="cpu",
                 workdir=Path(tempfile.mkdtemp(prefix="bench_loop_")))
    titan = build_titan_model(shape, seed=0)
    state = {**dict(titan.named_parameters()), **dict(titan.named_buffers())}
    WeightSync(WeightSyncConfig(), reference=state, generator=gen).sync(state, version=1)
    return gen


def worker(args) -> dict:
    import torchtitan_rl
    from torchtitan_rl.config import SamplingConfig

    gen = build(args.sequences, args.max_tokens, args.prompt_len)
    rng = random.Random(0)
    prompts = [[rng.randrange(16) for _ in range(args.prompt_len)] for _ in range(args.sequences // args.n)]
    sampling = SamplingConfig(temperature=1.0, max_tokens=args.max_tokens)
    llm = gen.engine
    inside = {"s": 0.0, "cpu": 0.0, "steps": 0}
    real_step = llm.step

    def step():
        t, c = time.perf_counter(), time.thread_time()
        try:
            return real_step()
        finally:
            inside["s"] += time.perf_counter() - t
            inside["cpu"] += time.thread_time() - c
            inside["steps"] += 1

    llm.step = step
    collections = {"n": 0, "s": 0.0, "t": 0.0}

    def on_gc(phase, info):
        if phase == "start":
            collections["t"] = time.perf_counter()
        else:
            collections["n"] += 1
            collections["s"] += time.perf_counter() - collections["t"]

    gen.generate(prompts, n=args.n, sampling=sampling, seed=1)  # warm-up
    gc.callbacks.append(on_gc)
    runs = []
    for _ in range(args.repeats):
        inside.update(s=0.0, cpu=0.0, steps=0)
        collections.update(n=0, s=0.0)
        t, c = time.perf_counter(), time.thread_time()
        out = gen.generate(prompts, n=args.n, sampling=sampling, seed=1)
        wall, cpu = time.perf_counter() - t, time.thread_time() - c
        steps = inside["steps"]
        runs.append({"steps": steps, "tokens": sum(len(x) for x in out.completion_ids),
                     "ms_per_step": 1e3 * wall / steps, "cpu_ms_per_step": 1e3 * cpu / steps,
                     "outside_step_ms": 1e3 * (wall - inside["s"]) / steps,
                     "outside_step_cpu_ms": 1e3 * (cpu - inside["cpu"]) / steps,
                     "gc_collections": collections["n"], "gc_s": collections["s"]})
    gc.callbacks.remove(on_gc)
    result = {"code": str(Path(torchtitan_rl.__file__).resolve().parents[1]), "runs": runs}
    if args.calls:
        result["calls"] = time_calls(gen, prompts, n=args.n, sampling=sampling, count=args.calls)
    return result


def time_calls(gen, prompts, *, n: int, sampling, count: int) -> dict:
    """Microseconds per call of compat.scheduler_load and TraceRecorder.iteration with every request of a
    generate admitted and running (this checkout only: the older one has neither)."""
    from torchtitan_rl import compat
    from torchtitan_rl.engine.engine import sampling_params
    from torchtitan_rl.engine.trace import TraceRecorder

    llm = gen.engine
    for i, prompt in enumerate(prompts):
        for j in range(n):
            llm.add_request(f"calls{i}_{j}", {"prompt_token_ids": list(prompt)},
                            sampling_params(sampling, stop_token_ids=None, seed=i * n + j))
    for _ in range(3):  # admitted and running
        llm.step()
    running, waiting, preempted, context = compat.scheduler_load(llm)
    t = time.perf_counter()
    for _ in range(count):
        compat.scheduler_load(llm)
    load_us = 1e6 * (time.perf_counter() - t) / count
    recorder = TraceRecorder(sequences=running + waiting, max_num_seqs=running + waiting,
                             kv_token_bytes=gen.kv_token_bytes)
    t = time.perf_counter()
    for _ in range(count):
        recorder.iteration(running=running, waiting=waiting, preempted=preempted, context=context)
    iteration_us = 1e6 * (time.perf_counter() - t) / count
    compat.abort_requests(llm, [f"calls{i}_{j}" for i in range(len(prompts)) for j in range(n)])
    while llm.has_unfinished_requests() or compat.batches_in_flight(llm):
        llm.step()
    return {"requests": running + waiting, "running": running, "scheduler_load_us": load_us,
            "trace_iteration_us": iteration_us}


def run_worker(code: Path, args, calls: int) -> dict:
    """The worker in a fresh process importing torchtitan_rl from ``code``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker-out", str(out),
               "--sequences", str(args.sequences), "--n", str(args.n), "--max-tokens", str(args.max_tokens),
               "--prompt-len", str(args.prompt_len), "--repeats", str(args.repeats), "--calls", str(calls)]
        env = {**os.environ, "PYTHONPATH": str(code)}
        if subprocess.run(cmd, env=env, cwd=code).returncode != 0 or not out.exists():
            raise SystemExit(f"FAIL: the worker on {code} failed")
        result = json.loads(out.read_text())
    assert Path(result["code"]) == code.resolve(), (result["code"], code)  # it imported the checkout asked for
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, default=None, help="a checkout of an older commit to compare with")
    parser.add_argument("--sequences", type=int, default=512)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed generates per process")
    parser.add_argument("--rounds", type=int, default=2, help="processes per checkout, alternating which goes first")
    parser.add_argument("--calls", type=int, default=20000, help="calls of scheduler_load / iteration timed")
    parser.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    parser.add_argument("--worker-out", default=None)
    args = parser.parse_args()
    if args.worker_out:
        Path(args.worker_out).write_text(json.dumps(worker(args)))
        sys.stdout.flush()
        os._exit(0)  # skip vLLM's engine teardown

    codes = {"this checkout": REPO}
    if args.before is not None:
        commit = subprocess.run(["git", "-C", str(args.before), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or args.before.name
        codes[f"before ({commit})"] = args.before.resolve()
    runs: dict[str, list[dict]] = {name: [] for name in codes}
    calls = None
    for r in range(args.rounds):
        order = list(codes) if r % 2 == 0 else list(reversed(codes))
        for name in order:
            result = run_worker(codes[name], args, args.calls if name == "this checkout" and calls is None else 0)
            runs[name] += result["runs"]
            calls = calls or result.get("calls")

    def med(name, key):
        return statistics.median(run[key] for run in runs[name])

    keys = ["ms_per_step", "cpu_ms_per_step", "outside_step_ms", "outside_step_cpu_ms"]
    rows = []
    for name in codes:
        rows.append([name, len(runs[name]), int(med(name, "steps")), *(f"{med(name, k):.3f}" for k in keys),
                     sum(run["gc_collections"] for run in runs[name]),
                     f"{1e3 * sum(run['gc_s'] for run in runs[name]):.1f}"])
    if args.before is not None:
        now, old = codes
        rows.append(["ratio this / before", "", "", *(f"{med(now, k) / med(old, k):.2f}" for k in keys), "", ""])
    header = ["code", "generates", "engine steps", "ms / step (wall)", "ms / step (CPU)", "outside step ms",
              "outside step CPU ms", "gc collections (sum)", "gc ms (sum)"]
    body = (f"{args.sequences} sequences ({args.sequences // args.n} prompts x {args.n}) of {args.max_tokens} tokens "
            f"at once (max_num_seqs {args.sequences}, tiny Qwen3, enforce_eager), {args.repeats} timed generates "
            f"per process after a warm-up, {args.rounds} processes per checkout; medians over generates. "
            "'outside step': generate's time outside LLMEngine.step, per step (our loop). CPU: the loop "
            "thread's CPU time (holds on a loaded machine where wall does not).\n\n" + table(header, rows))
    if calls:
        body += (f"\nAlone, at {calls['requests']} admitted requests ({calls['running']} running), per call: "
                 f"compat.scheduler_load {calls['scheduler_load_us']:.2f} us, TraceRecorder.iteration "
                 f"{calls['trace_iteration_us']:.2f} us.\n")
    print(body)
    print(json.dumps(runs, indent=1))
    if args.write:
        write_section("Engine step loop: host time per step (CPU)", device="cpu", body=body)


if __name__ == "__main__":
    main()
