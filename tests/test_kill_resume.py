"""kill -9 at several moments of a run's saves, then --resume: metrics.jsonl ends as the uninterrupted run's.

Real processes (python -m torchtitan_rl.simple_grpo on cpu_tiny) killed with SIGKILL when the run folder shows
a chosen moment: a checkpoint's shards being written, its manifest just written, a step's metrics line written
before its checkpoint. Each restart is the same command with --resume.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO, not_measured, repo_env

CPU_TINY = REPO / "run_configs" / "cpu_tiny.toml"
STEPS = 8
ARGS = ["--config", str(CPU_TINY), "--trainer.steps", str(STEPS), "--grpo.prompts_per_step", "8",
        "--trainer.checkpoint.enable", "--trainer.checkpoint.interval", "2"]


def _start(out: Path, *extra: str) -> subprocess.Popen:
    env = repo_env()
    log = open(out.with_name(out.name + ".log"), "a")
    return subprocess.Popen([sys.executable, "-m", "torchtitan_rl.simple_grpo", *ARGS, "--job.output_dir", str(out),
                             *extra], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _steps_logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def _kill_when(proc: subprocess.Popen, moment, timeout_s: float = 300) -> None:
    """SIGKILL proc as soon as moment() is true (polled every millisecond)."""
    deadline = time.monotonic() + timeout_s
    while not moment():
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before the moment came"
        assert time.monotonic() < deadline, "the moment never came"
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()


def _records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [not_measured(json.loads(line)) for line in lines]


@pytest.mark.slow
def test_kill_9_during_saves_then_resume_gives_the_uninterrupted_metrics(tmp_path):
    reference = _start(tmp_path / "reference")  # uninterrupted, beside the first run that is killed
    out = tmp_path / "killed"
    run, ckpt = out / "run-1", out / "run-1" / "checkpoints"
    # 1. while step-4's shards are being written (step-2 is complete)
    _kill_when(_start(out), lambda: (ckpt / "step-4.tmp").exists())
    assert reference.wait(timeout=300) == 0
    expected = _records(tmp_path / "reference" / "run-1")
    assert [r["step"] for r in expected] == list(range(STEPS))
    # 2. once step-6's manifest is written (in step-6.tmp, or already renamed to step-6)
    _kill_when(_start(out, "--resume"), lambda: (ckpt / "step-6.tmp" / "manifest.json").exists()
               or (ckpt / "step-6").exists())
    # 3. after step 7's metrics line, before (or while) its checkpoint step-8 is written
    _kill_when(_start(out, "--resume"), lambda: 7 in _steps_logged(run))
    assert sorted(os.listdir(out)) == ["latest", "run-1"]  # every restart continued the same run
    last = _start(out, "--resume")
    assert last.wait(timeout=300) == 0, (out.with_name("killed.log")).read_text()[-3000:]

    got = _records(run)
    assert [r["step"] for r in got] == list(range(STEPS))  # every step once, none missing
    assert got == expected  # and each with the uninterrupted run's numbers
