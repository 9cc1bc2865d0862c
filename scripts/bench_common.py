"""Shared by the scripts/bench_*.py: timing and writing tables to docs/benchmarks.md."""

import datetime
import platform
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(fn, *, device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of ``fn()`` with the device drained before each read."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    import os

    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores (torch {torch.__version__})"


def write_section(name: str, *, device: str, body: str, path: Path = BENCHMARKS_MD, made_on: str | None = None) -> None:
    """Replace (or add) the section ``name`` of docs/benchmarks.md; ``made_on``: the machine, when the table is
    made elsewhere than where its numbers were measured."""
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    today = datetime.date.today().isoformat()
    section = (
        f"<!-- {name} -->\n## {name}\n\n"
        f"- command: `{command}`\n- machine: {made_on or machine(device)}\n- date: {today}\n\n"
        f"{body.rstrip()}\n<!-- /{name} -->\n"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n\nEvery table: the command that made it, the machine, the date.\n\n"
    pattern = re.compile(rf"<!-- {re.escape(name)} -->.*?<!-- /{re.escape(name)} -->\n", re.S)
    text = pattern.sub(lambda _: section, text) if pattern.search(text) else text.rstrip() + "\n\n" + section
    path.write_text(text)
    print(section)


def run_modes(modes: tuple[str, ...], *, device: str, worker_mode: str | None, worker_out: str | None, compute):
    """``compute(mode)`` for each mode: in this process on CPU, in a process of
    its own on CUDA, where vLLM's batch-invariant kernels, once on, are on for
    the whole process. A worker (this script re-run with --worker-mode/--worker-out)
    writes its result as JSON and exits without vLLM's engine teardown."""
    import json
    import os
    import subprocess
    import tempfile

    if worker_mode:
        Path(worker_out).write_text(json.dumps(compute(worker_mode)))
        sys.stdout.flush()
        os._exit(0)
    results = {}
    for mode in modes:
        if device == "cpu":
            results[mode] = compute(mode)
            continue
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, *sys.argv, "--worker-mode", mode, "--worker-out", str(out)]
            if subprocess.run(cmd).returncode != 0 or not out.exists():
                raise SystemExit(f"FAIL: the {mode} run failed")
            results[mode] = json.loads(out.read_text())
    return results


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
