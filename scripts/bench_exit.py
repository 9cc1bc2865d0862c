"""How long a finished run's process lives after its last line: `python -m torchtitan_rl.simple_grpo` on
run_configs/cpu_tiny.toml for a few steps, each output line timestamped as it arrives.

    python scripts/bench_exit.py [--runs 3] [--steps 2] [--no-write] [-- extra simple_grpo args]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run(extra: list[str], steps: int) -> tuple[float, float, str]:
    """(seconds from the last line to the end, the whole run's wall, the last line)."""
    with tempfile.TemporaryDirectory() as out:
        env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"}
        env["PYTHONPATH"] = str(REPO)
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "torchtitan_rl.simple_grpo", "--config", str(REPO / "run_configs" / "cpu_tiny.toml"),
             "--trainer.steps", str(steps), "--grpo.prompts_per_step", "8", "--job.output_dir", out, *extra],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        last_at, last, tail = started, "", b""
        while chunk := os.read(proc.stdout.fileno(), 65536):
            *lines, tail = (tail + chunk).replace(b"\r", b"\n").split(b"\n")
            for line in lines:
                if line.strip():
                    last_at, last = time.perf_counter(), line.decode(errors="replace")
        proc.wait()
        ended = time.perf_counter()
        if proc.returncode:
            raise SystemExit(f"the run failed with exit {proc.returncode}: {last}")
        return ended - last_at, ended - started, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--no-write", action="store_true")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    results = [one_run(extra, args.steps) for _ in range(args.runs)]
    lags = [lag for lag, _, _ in results]
    body = (f"{args.runs} runs of {args.steps} steps (`--grpo.prompts_per_step 8`). Exit after the last line: median "
            f"{statistics.median(lags):.2f} s (each: {', '.join(f'{lag:.2f}' for lag in lags)}); whole process "
            f"median {statistics.median(w for _, w, _ in results):.1f} s. Last line: `{results[-1][2][:80]}...`\n")
    if args.no_write:
        print(body)
        return
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_common import write_section

    write_section("Exit after the last line (cpu)", device="cpu", body=body)


if __name__ == "__main__":
    main()
