"""One JSON line summarising a GPU run: step-time medians from its run folder, peak memory from nvidia-smi samples
and from the loop's own readings by phase (metrics.jsonl's mem_<phase>_gib).

Runs write ``<job.output_dir>/run-N/metrics.jsonl`` and point ``<job.output_dir>/latest`` at the newest run, so
this reads ``latest/metrics.jsonl`` (or the folder itself when it is a run folder). The layout and size scripts
under scripts/gpu/ call it after each run; tests/scripts/test_gpu_summaries.py runs it on a real CPU run folder.

    python3 scripts/gpu/summarize_run.py OUTPUT_DIR --name every4 --gpus 0,1,2,3 --mem mem.csv --rc 0 \\
        --engines 4 --window 3 13 [--extra key=value ...]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

KEYS = ("step_s", "generate_s", "train_s", "sync_s", "wait_rollouts_s", "generator_idle_s", "gen_tokens_per_s",
        "gen_tail_share", "gen_after_need_s", "gen_batch_fill", "gen_preemptions", "gen_kv_read_tb_per_s",
        "gen_tail_kv_read_tb_per_s", "gen_engine_balance", "train_rank_balance")
"""Per-step numbers of metrics.jsonl (torchtitan_rl/run/metrics.py StepMetrics) whose medians the tables show."""


def metrics_file(output_dir: Path) -> Path | None:
    """The metrics.jsonl of the newest run under output_dir (its ``latest`` link), or of output_dir itself."""
    for candidate in (output_dir / "latest" / "metrics.jsonl", output_dir / "metrics.jsonl"):
        if candidate.is_file():
            return candidate
    return None


def step_records(path: Path | None) -> list[dict]:
    """The per-step lines of a metrics.jsonl (evaluation lines carry no step_s)."""
    if path is None:
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if "step_s" in r]


def peak_memory_mib(mem_csv: Path | None, gpus: list[int]) -> dict[int, int]:
    """Peak of nvidia-smi's `index, memory.used` samples (MiB) on each of ``gpus``."""
    peak = {gpu: 0 for gpu in gpus}
    if mem_csv is None or not mem_csv.is_file():
        return peak
    for line in mem_csv.read_text().splitlines():
        try:
            gpu, used = (int(x) for x in line.split(","))
        except ValueError:
            continue  # a line cut by the sampler's kill
        if gpu in peak:
            peak[gpu] = max(peak[gpu], used)
    return peak


def peak_phase_memory(records: list[dict]) -> dict[str, float]:
    """Phase -> the largest of the loop's readings of its first rank's GPU in that phase (StepMetrics.memory), over
    every step logged: what to set beside the estimate's phases (its "memory per GPU" line)."""
    keys = sorted({k for r in records for k in r if k.startswith("mem_") and k.endswith("_gib")})
    return {k.removeprefix("mem_").removesuffix("_gib"): round(max(r[k] for r in records if k in r), 1) for k in keys}


def summarize(output_dir: Path, *, name: str, gpus: list[int], mem_csv: Path | None, rc: int, engines: int,
              window: tuple[int, int], extra: dict) -> dict:
    path = metrics_file(output_dir)
    records = step_records(path)
    first, last = window
    kept = [r for r in records if first <= r["step"] <= last]
    med = {k: statistics.median(r[k] for r in kept if k in r) for k in KEYS if any(k in r for r in kept)}
    summary = {
        "layout": name, "exit_code": rc, "gpus": gpus, "metrics": str(path) if path else None,
        "steps_logged": len(records), "window": [first, last], "steps_in_window": len(kept),
        f"median_steps_{first}_{last}": med,
        "tokens_per_s_per_engine": med["gen_tokens_per_s"] / engines if "gen_tokens_per_s" in med else None,
        "engines": engines,
        "peak_gpu_mem_gib": {gpu: round(mib / 1024, 1) for gpu, mib in peak_memory_mib(mem_csv, gpus).items()},
        "peak_phase_mem_gib": peak_phase_memory(records),
        "reward_first_last": [records[0]["reward_mean"], records[-1]["reward_mean"]] if records else None,
        **extra,
    }
    if not kept:
        summary["problem"] = (f"no step in {first}..{last}" if records else
                              f"no metrics.jsonl under {output_dir} (latest/ or the folder itself)")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir", type=Path, help="the run's job.output_dir")
    parser.add_argument("--name", required=True)
    parser.add_argument("--gpus", default="", help="comma-separated GPU indices the run used")
    parser.add_argument("--mem", type=Path, default=None, help="nvidia-smi index,memory.used samples")
    parser.add_argument("--rc", type=int, default=0)
    parser.add_argument("--engines", type=int, default=1, help="vLLM engines that shared each generate")
    parser.add_argument("--window", type=int, nargs=2, default=(3, 13), help="first and last step of the medians")
    parser.add_argument("--extra", nargs="*", default=[], help="key=value pairs copied into the line")
    args = parser.parse_args(argv)
    gpus = [int(g) for g in args.gpus.split(",") if g != ""]
    extra = dict(kv.split("=", 1) for kv in args.extra)
    line = summarize(args.output_dir, name=args.name, gpus=gpus, mem_csv=args.mem, rc=args.rc,
                     engines=args.engines, window=tuple(args.window), extra=extra)
    print(json.dumps(line))
    return 0 if "problem" not in line and args.rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
