"""Does generation slow down step after step? The GRPO loop's own command, with per-step diagnostics.

Runs ``python -m torchtitan_rl.simple_grpo --config CONFIG --trainer.steps N`` in
this process (the same main(), checkpoints as the config says), with
Engine.generate wrapped to record, per step: generated tokens/s, engine
steps (decode iterations; one wave of all samples is ~max_tokens of them),
the most requests running at once, the fewest free KV-cache blocks, requests
preempted, time in engine.step vs the rest, the caching allocator's counters
during the generate (cudaMalloc/cudaFree calls, allocation retries after
freeing the cache, reserved and fragmented bytes), the driver's free memory,
Python GC time during the generate, and the process RSS. The loop's own
metrics.jsonl (step_s, train_s) is merged in.

    python3 scripts/gpu/gen_drift.py --steps 22 [--out drift.json] [--config ...] [--section.field value ...]

Which torchtitan_rl it runs is PYTHONPATH's: this script measures any version.
"""

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def _rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return 0.0


CUDA = torch.cuda.is_available()


def _alloc_counters() -> dict:
    s = torch.cuda.memory_stats() if CUDA else {}
    return {
        "device_mallocs": s.get("num_device_alloc", 0),
        "device_frees": s.get("num_device_free", 0),
        "alloc_retries": s.get("num_alloc_retries", 0),
        "reserved_gib": s.get("reserved_bytes.all.current", 0) / 2**30,
        "allocated_gib": s.get("allocated_bytes.all.current", 0) / 2**30,
        "inactive_split_gib": s.get("inactive_split_bytes.all.current", 0) / 2**30,
    }


def _scheduler(engine):
    """vLLM V1's in-process scheduler (LLMEngine -> InprocClient -> EngineCore -> Scheduler), or None."""
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)


def install(records: list) -> None:
    from torchtitan_rl.engine.engine import Engine

    real_generate = Engine.generate
    gc_time = [0.0, 0]
    gc_start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            gc_time[0] += time.perf_counter() - gc_start[0]
            gc_time[1] += info.get("generation") == 2

    gc.callbacks.append(on_gc)

    def generate(self, *args, **kwargs):
        engine = self.engine
        sched = _scheduler(engine)
        real_step = engine.step
        stats = {"engine_steps": 0, "engine_step_s": 0.0, "max_running": 0, "min_free_blocks": None,
                 "preempted": set()}

        def step():
            t = time.perf_counter()
            out = real_step()
            stats["engine_step_s"] += time.perf_counter() - t
            stats["engine_steps"] += 1
            if sched is not None:
                stats["max_running"] = max(stats["max_running"], len(sched.running))
                free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
                m = stats["min_free_blocks"]
                stats["min_free_blocks"] = free if m is None else min(m, free)
                stats["preempted"].update(r.request_id for r in sched.running if r.num_preemptions)
            return out

        engine.step = step
        if CUDA:
            torch.cuda.synchronize()
        before = _alloc_counters()
        gc_before = list(gc_time)
        free_before = torch.cuda.mem_get_info()[0] / 2**30 if CUDA else 0.0
        blocks_total = sched.kv_cache_manager.block_pool.num_gpu_blocks if sched is not None else None
        free_blocks_start = sched.kv_cache_manager.block_pool.get_num_free_blocks() if sched is not None else None
        t = time.perf_counter()
        try:
            rollouts = real_generate(self, *args, **kwargs)
        finally:
            del engine.step  # back to the class's method
        wall = time.perf_counter() - t
        after = _alloc_counters()
        tokens = sum(len(c) for c in rollouts.completion_ids)
        records.append({
            "gen_s": wall, "gen_tokens": tokens, "gen_tokens_per_s": tokens / wall,
            "engine_steps": stats["engine_steps"], "engine_step_s": stats["engine_step_s"],
            "outside_engine_step_s": wall - stats["engine_step_s"],
            "max_running": stats["max_running"], "min_free_blocks": stats["min_free_blocks"],
            "free_blocks_at_start": free_blocks_start, "blocks_total": blocks_total,
            "preempted_requests": len(stats["preempted"]),
            "device_mallocs": after["device_mallocs"] - before["device_mallocs"],
            "device_frees": after["device_frees"] - before["device_frees"],
            "alloc_retries": after["alloc_retries"] - before["alloc_retries"],
            "reserved_gib": after["reserved_gib"], "allocated_gib_before": before["allocated_gib"],
            "inactive_split_gib_before": before["inactive_split_gib"],
            "driver_free_gib_before": free_before,
            "gc_s": gc_time[0] - gc_before[0], "gc_gen2": gc_time[1] - gc_before[1],
            "rss_gib": _rss_gib(), "python_objects": len(gc.get_objects()),
        })
        r = records[-1]
        print(f"[gen_drift] generate {len(records) - 1}: {r['gen_tokens_per_s']:,.0f} tok/s, {wall:.2f} s "
              f"(engine.step {r['engine_step_s']:.2f} s x {r['engine_steps']}), running<= {r['max_running']}, "
              f"free blocks {r['free_blocks_at_start']}->{r['min_free_blocks']}/{r['blocks_total']}, "
              f"preempted {r['preempted_requests']}, mallocs {r['device_mallocs']} frees {r['device_frees']} "
              f"retries {r['alloc_retries']}, reserved {r['reserved_gib']:.1f} GiB, "
              f"split {r['inactive_split_gib_before']:.2f} GiB, driver free {free_before:.1f} GiB, "
              f"gc {r['gc_s']:.2f} s ({r['gc_gen2']} full), rss {r['rss_gib']:.2f} GiB, "
              f"objects {r['python_objects']:,}", flush=True)
        return rollouts

    Engine.generate = generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="run_configs/qwen3_0.6b.toml")
    parser.add_argument("--steps", type=int, default=22)
    parser.add_argument("--out", default=None)
    args, overrides = parser.parse_known_args()

    from torchtitan_rl.simple_grpo import main as grpo_main

    records: list = []
    install(records)
    workdir = Path(tempfile.mkdtemp(prefix="drift_"))
    argv = ["--config", args.config, "--trainer.steps", str(args.steps), "--job.output_dir", str(workdir), *overrides]
    t = time.perf_counter()
    grpo_main(argv)
    wall = time.perf_counter() - t
    loop = [json.loads(line) for line in (workdir / "latest" / "metrics.jsonl").read_text().splitlines()]
    loop = [r for r in loop if "step_s" in r]
    for rec, row in zip(records, loop):
        rec.update({k: row[k] for k in ("step", "step_s", "train_s", "sync_s", "mismatch_max", "mismatch_mean")
                    if k in row})
    rates = [r["gen_tokens_per_s"] for r in records]
    kept = rates[2:] or rates
    summary = {
        "argv": argv, "wall_s": wall, "steps": len(records),
        "gen_tokens_per_s_first_last": [rates[0], rates[-1]],
        "gen_tokens_per_s_steps2on_min_median_max": [min(kept), statistics.median(kept), max(kept)],
        "spread_steps2on": (max(kept) - min(kept)) / statistics.median(kept),
        "step_s_steps2on_median": statistics.median(r["step_s"] for r in records[2:]) if len(records) > 2 else None,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if CUDA else 0.0,
    }
    print("[gen_drift] summary " + json.dumps(summary))
    print("[gen_drift] step  tok/s  step_s  train_s  engine_steps  mallocs  retries  gc_s")
    for i, r in enumerate(records):
        print(f"[gen_drift] {i:4d} {r['gen_tokens_per_s']:7.0f} {r.get('step_s', 0):7.2f} {r.get('train_s', 0):7.2f} "
              f"{r['engine_steps']:6d} {r['device_mallocs']:8d} {r['alloc_retries']:6d} {r['gc_s']:6.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "per_step": records}, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
