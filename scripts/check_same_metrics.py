"""Do two checkouts train the same? Runs the CPU loop in three layouts in each and compares every metric but the
machine's measurements (timings, memory readings).

A refactor that moves code must leave what a run computes unchanged. For each checkout (a git worktree of the
commit before and one of the commit after), this runs, one after another on this machine:

    colocated   python -m torchtitan_rl.simple_grpo --config run_configs/cpu_tiny.toml (40 steps: the learning run)
    nccl        3 processes (2 trainer ranks + 1 generator rank, gloo on CPU) through torchtitan_rl.launch, 10 steps
    server      python -m torchtitan_rl.serve, and a trainer syncing to it over HTTP (transport server), 10 steps

and compares their metrics.jsonl line by line, every field but timings (``*_s``, the generate's time shares), memory
readings (``mem_*_gib``) and fields the commit after adds. Exit 0 only if all three are equal; prints the first
differing field otherwise.

    git worktree add /tmp/before <commit>
    python scripts/check_same_metrics.py --before /tmp/before --after . --out /tmp/same_metrics
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from torchtitan_rl.run.metrics import is_measured

CONFIG = "run_configs/cpu_tiny.toml"
TOKEN = "check-same-metrics-token"


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "latest" / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not is_measured(k)} for line in lines]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(checkout: Path, args: list[str], log: Path, env: dict | None = None) -> None:
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, *args], cwd=checkout, stdout=f, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONPATH": str(checkout), **(env or {})}, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{checkout}: {' '.join(args[:4])} ... failed (exit {proc.returncode}); see {log}")


def colocated(checkout: Path, out: Path) -> None:
    run(checkout, ["-m", "torchtitan_rl.simple_grpo", "--config", CONFIG, "--trainer.steps", "40",
                   "--job.output_dir", str(out)], out.with_suffix(".log"))


def nccl(checkout: Path, out: Path) -> None:
    run(checkout, ["-m", "torchtitan_rl.launch", "--nproc-per-node", "3", "--master-port", str(free_port()),
                   "-m", "torchtitan_rl.simple_grpo", "--config", CONFIG, "--weight_sync.transport", "nccl",
                   "--trainer.steps", "10", "--job.output_dir", str(out)], out.with_suffix(".log"))


def server(checkout: Path, out: Path) -> None:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(checkout), "TORCHTITAN_RL_SERVE_TOKEN": TOKEN}
    with open(out.with_suffix(".server.log"), "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "torchtitan_rl.serve", "--config", CONFIG, "--job.output_dir",
                                 str(out) + ".server", "--serve.port", str(port)],
                                cwd=checkout, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError as e:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{checkout}: the rollout server did not come up ({e})") from None
                time.sleep(0.5)
        run(checkout, ["-m", "torchtitan_rl.simple_grpo", "--config", CONFIG, "--weight_sync.transport", "server",
                       "--serve.port", str(port), "--trainer.steps", "10", "--job.output_dir", str(out)],
            out.with_suffix(".log"), env={"TORCHTITAN_RL_SERVE_TOKEN": TOKEN})
    finally:
        proc.terminate()
        proc.wait(timeout=60)


LAYOUTS = {"colocated": colocated, "nccl": nccl, "server": server}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the commit before")
    parser.add_argument("--after", type=Path, required=True, help="checkout of the commit after")
    parser.add_argument("--out", type=Path, required=True, help="where the runs go (created)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    failed = False
    for layout in args.layouts:
        runs = {}
        for side in ("before", "after"):
            checkout = getattr(args, side).resolve()
            out = args.out / side / layout
            out.parent.mkdir(parents=True, exist_ok=True)
            start = time.monotonic()
            LAYOUTS[layout](checkout, out)
            runs[side] = metrics(out)
            print(f"{layout:9s} {side:6s} {len(runs[side])} steps in {time.monotonic() - start:.0f} s", flush=True)
        before, after = runs["before"], runs["after"]
        diff = next(((i, k, b[k], a.get(k)) for i, (b, a) in enumerate(zip(before, after)) for k in b
                     if a.get(k) != b[k]), None)
        # a field only after is a new metric (compared from its first commit on); one only before was lost
        lost, added = set(before[0]) - set(after[0]), sorted(set(after[0]) - set(before[0]))
        if len(before) != len(after) or diff is not None or lost:
            failed = True
            print(f"{layout:9s} DIFFERENT: {len(before)} vs {len(after)} steps; first difference (step, field, "
                  f"before, after): {diff}; fields lost: {lost}")
        else:
            print(f"{layout:9s} SAME: {len(before)} steps x {len(before[0])} non-measured fields equal"
                  + (f"; new fields {added}" if added else ""))
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
