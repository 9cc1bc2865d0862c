"""The mission command, timed: median step of ``python -m torchtitan_rl.simple_grpo --config
run_configs/qwen3_0.6b.toml`` over a few steps, with generator overrides (one variant per call).

Runs the command itself (a subprocess, as a user does) with ``--trainer.steps`` and ``--job.output_dir``
set, then reads the run's metrics.jsonl (``<output_dir>/latest``) and writes to ``--out``:
mission_<name>.json (medians of steps ``--skip``.., every step's step_s / generate_s / train_s / sync_s /
gen_tokens_per_s) and mission_<name>_metrics.jsonl (the run's own file; links do not come back from $OUT).

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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEYS = ("step_s", "generate_s", "train_s", "sync_s", "gen_tokens_per_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True)
    parser.add_argument("--config", default="run_configs/qwen3_0.6b.toml")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--skip", type=int, default=1, help="warm-up steps left out of the medians (step 0 compiles)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    output_dir = Path(tempfile.mkdtemp(prefix=f"mission_{args.name}_"))
    cmd = [sys.executable, "-m", "torchtitan_rl.simple_grpo", "--config", args.config,
           "--trainer.steps", str(args.steps), "--job.output_dir", str(output_dir), *overrides]
    print("[mission_step]", " ".join(cmd), flush=True)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO)
    wall = time.perf_counter() - t
    metrics = output_dir / "latest" / "metrics.jsonl"
    records = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step_s" in r] if metrics.is_file() else []
    kept = [r for r in records if r["step"] >= args.skip]
    summary = {
        "name": args.name, "command": cmd[1:], "exit": proc.returncode, "wall_s": wall, "steps": len(records),
        "median": {k: statistics.median(r[k] for r in kept) for k in KEYS} if kept else {},
        "per_step": {k: [round(r[k], 4) for r in records] for k in KEYS},
    }
    out = Path(args.out)
    (out / f"mission_{args.name}.json").write_text(json.dumps(summary, indent=1))
    if metrics.is_file():
        shutil.copyfile(metrics, out / f"mission_{args.name}_metrics.jsonl")
    print(json.dumps({k: summary[k] for k in ("name", "exit", "wall_s", "steps", "median")}, indent=1), flush=True)
    if proc.returncode:
        raise SystemExit(proc.returncode)


if __name__ == "__main__":
    main()
