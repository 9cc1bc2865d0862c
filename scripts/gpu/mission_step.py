"""The mission command, timed: median step of ``python -m torchtitan_rl.simple_grpo --config
run_configs/qwen3_0.6b.toml`` over a few steps, with generator overrides (one variant per call).

Runs the command itself (a subprocess, as a user does) with ``--trainer.steps`` and ``--job.output_dir``
set, then reads the run's metrics.jsonl (``<output_dir>/latest``) and writes to ``--out``:
mission_<name>.json (medians of steps ``--skip``.., every step's step_s / generate_s / train_s / sync_s /
gen_tokens_per_s and the loop's other timers; ``start_s``: from the command to step 0's start, i.e. the
engine's and trainer's builds; ``exit_lag_s``: from the run's last line to the process's end, what a shell
waits; ``output_closed_lag_s``: to the end of its output, later when a child it left (a compile worker) still
holds the pipe, what ``| tee`` waits; ``trained_lag_s``: to the run's return, before the process group's destroy;
``returned_lag_s``: to the run's main returning, after which only the process's own end is left, os._exit's
teardown in the kernel and the GPU driver) and
mission_<name>_metrics.jsonl (the run's own file; links do not come back from $OUT). ``--launch N`` runs it
under ``python -m torchtitan_rl.launch --nproc-per-node N``; ``--cap-gib G`` under scripts/gpu/capped.py.

    python3 scripts/gpu/mission_step.py --name compile --steps 14 -- --generator.compile true
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from torchtitan_rl.run.exits import EXIT_TIMES  # noqa: E402
KEYS = ("step_s", "generate_s", "train_s", "sync_s", "gen_tokens_per_s")
OTHER = ("wait_rollouts_s", "evaluation_s", "build_s", "recompute_s", "log_s", "checkpoint_s")
"""The loop's other timers (absent from runs before they existed)."""


def timed_lines(proc: subprocess.Popen) -> tuple[list[tuple[float, str]], float, float]:
    """The process's output lines (a progress bar's \\r ends one) with their arrival times, echoed; when the
    process ended; when its output closed (every process holding the pipe gone)."""
    ended = []

    def wait() -> None:
        proc.wait()
        ended.append(time.perf_counter())

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    lines, tail = [], b""
    while chunk := os.read(proc.stdout.fileno(), 65536):
        now = time.perf_counter()
        sys.stdout.buffer.write(chunk)
        sys.stdout.flush()
        *done, tail = (tail + chunk).replace(b"\r", b"\n").split(b"\n")
        lines += [(now, line.decode(errors="replace")) for line in done if line.strip()]
    closed = time.perf_counter()
    waiter.join()
    if tail.strip():
        lines.append((closed, tail.decode(errors="replace")))
    return lines, ended[0], closed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--config", default="run_configs/qwen3_0.6b.toml")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the medians (step 0 compiles)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--launch", type=int, default=0, help="processes under torchtitan_rl.launch (0: one, plain)")
    parser.add_argument("--cap-gib", type=float, default=0.0, help="run as on a GPU of this many GiB (capped.py)")
    parser.add_argument("--port", type=int, default=29571)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the run's environment")
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    output_dir = Path(tempfile.mkdtemp(prefix=f"mission_{args.name}_"))
    grpo = ["-m", "torchtitan_rl.simple_grpo"]
    if args.cap_gib:
        grpo = [str(REPO / "scripts" / "gpu" / "capped.py"), "--gib", str(args.cap_gib), *grpo]
    launch = ["-m", "torchtitan_rl.launch", "--nproc-per-node", str(args.launch), "--master-port", str(args.port)] \
        if args.launch else []
    cmd = [sys.executable, *launch, *grpo, "--config", args.config, "--trainer.steps", str(args.steps),
           "--job.output_dir", str(output_dir), *overrides]
    times = output_dir / "exit_times.json"  # not in the run folder: run/folder.py owns what is there
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.env), EXIT_TIMES: str(times)}
    print("[mission_step]", " ".join(cmd), flush=True)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, ended, closed = timed_lines(proc)
    clock = time.time() - time.perf_counter()  # perf_counter's times as wall-clock ones (the run writes those)
    wall = ended - t
    metrics = output_dir / "latest" / "metrics.jsonl"
    stamps = json.loads(times.read_text()) if times.is_file() else {}
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step_s" in r] if metrics.is_file() else []
    kept = [r for r in records if r["step"] >= args.skip]
    keys = KEYS + tuple(k for k in OTHER if records and k in records[0])
    # Step 0 ends when its metrics line is written; the bar's "1/N" line arrives then.
    first_done = next((at for at, line in lines if f" 1/{args.steps} " in line), None)
    summary = {
        "name": args.name, "command": cmd[1:], "env": args.env, "exit": proc.returncode, "wall_s": wall,
        "steps": len(records),
        "start_s": first_done - t - records[0]["step_s"] if first_done is not None and records else None,
        "exit_lag_s": ended - lines[-1][0] if lines else None,
        "output_closed_lag_s": closed - lines[-1][0] if lines else None,
        **{key: stamps[name] - clock - lines[-1][0] if lines and name in stamps else None
           for key, name in (("trained_lag_s", "trained"), ("returned_lag_s", "main_returned"))},
        "last_line": lines[-1][1][-300:] if lines else None,
        "median": {k: statistics.median(r[k] for r in kept) for k in keys} if kept else {},
        "per_step": {k: [round(r[k], 4) for r in records] for k in keys},
    }
    out = Path(args.out)
    (out / f"mission_{args.name}.json").write_text(json.dumps(summary, indent=1))
    if metrics.is_file():
        shutil.copyfile(metrics, out / f"mission_{args.name}_metrics.jsonl")
    shown = ("name", "exit", "wall_s", "start_s", "exit_lag_s", "output_closed_lag_s", "trained_lag_s",
             "returned_lag_s", "steps", "median")
    print(json.dumps({k: summary[k] for k in shown}, indent=1), flush=True)
    if proc.returncode:
        raise SystemExit(proc.returncode)


if __name__ == "__main__":
    main()
