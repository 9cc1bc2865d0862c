"""How a multi-process job ends: a signal or a dead rank stops every rank within seconds, with one line for the job.

The 3-process layout of the README (weight_sync.transport nccl: 2 trainer
ranks + 1 generator rank, gloo on CPU) run by our launcher (torchrun's agent,
launch.py) as a user runs it; each fault is caused for real: SIGINT to the
whole process group (Ctrl-C in a terminal), SIGTERM to the launcher (a
scheduler), kill -9 of one rank. A slow rank is a task (defined below) whose
reward sleeps on rank 0. The launcher adds no traceback and no report of its
own when a rank said why; torchrun itself still does (the last test).
"""

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from tests.helpers import REPO, free_port, repo_env
from torchtitan_rl.grpo.tasks.digits import DigitsTask

CPU_TINY = REPO / "run_configs" / "cpu_tiny.toml"
EXIT_S = 5.0
"""Every rank must be gone this long after the fault."""


class SlowRank0Digits(DigitsTask):
    """The digits task, but rank 0's first reward takes SLOW_S seconds: a long generate + score step."""

    SLOW_S = 90.0

    def __init__(self) -> None:
        super().__init__(mode="copy")
        self.slept = os.environ.get("RANK") != "0"

    def reward(self, prompt, completion_ids):
        if not self.slept:
            self.slept = True
            time.sleep(self.SLOW_S)
        return super().reward(prompt, completion_ids)


def slow_rank0_digits() -> SlowRank0Digits:
    return SlowRank0Digits()


class Rank1RefusesLater(DigitsTask):
    """The digits task, but rank 1's reward raises a user error once step 0 is over (its first reward plus
    AFTER_S): rank 0's progress bar then shows a step and leaves its line open on the shared stderr."""

    AFTER_S = 0.2

    def __init__(self) -> None:
        super().__init__(mode="copy")
        self.first = None

    def reward(self, prompt, completion_ids):
        if os.environ.get("RANK") == "1":
            self.first = self.first or time.monotonic()
            if time.monotonic() - self.first > self.AFTER_S:
                raise ValueError("grpo.task: rank 1 refuses this prompt")
        return super().reward(prompt, completion_ids)


def rank1_refuses_later() -> Rank1RefusesLater:
    return Rank1RefusesLater()


def _start(tmp_path: Path, nproc: int, *extra: str, launcher: str = "torchtitan_rl.launch") -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", launcher, "--nproc-per-node", str(nproc), "--master-port",
        str(free_port()), "-m", "torchtitan_rl.simple_grpo", "--config", str(CPU_TINY),
        "--job.output_dir", str(tmp_path), "--grpo.prompts_per_step", "8", *extra,
    ]
    env = repo_env()
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group, as a shell gives a foreground job


def _our_lines(stderr: str) -> list[str]:
    """What the job said about its end (the libraries' start-up warnings left out): the torchtitan_rl lines and
    any traceback line, the ranks' or the launcher's."""
    return [line for line in stderr.splitlines() if line.startswith("torchtitan_rl:") or "Traceback" in line]


@contextmanager
def _reaped(proc: subprocess.Popen):
    """Whatever the block asserts, no process of the job outlives it."""
    try:
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def _wait_training(proc: subprocess.Popen, out: Path) -> None:
    deadline = time.monotonic() + 300
    metrics = out / "latest" / "metrics.jsonl"  # run/folder.py: the run's folder is output_dir/latest
    while not metrics.exists() or not metrics.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["sigint_group", "sigterm_torchrun", "kill_trainer_rank_1"])
def test_fault_in_the_nccl_layout_ends_every_rank_within_5_s_with_one_line(tmp_path, fault):
    proc = _start(tmp_path, 3, "--weight_sync.transport", "nccl", "--trainer.steps", "500")
    with _reaped(proc):
        _wait_training(proc, tmp_path)  # every rank is in its loop (the generator serving, the trainers waiting)
        ranks = psutil.Process(proc.pid).children()
        assert len(ranks) == 3
        t0 = time.monotonic()
        if fault == "sigint_group":
            os.killpg(proc.pid, signal.SIGINT)
        elif fault == "sigterm_torchrun":
            proc.send_signal(signal.SIGTERM)
        else:
            rank_1 = next(r for r in ranks if "RANK=1" in _environ(r))
            rank_1.kill()
        _, alive = psutil.wait_procs(ranks, timeout=EXIT_S)
        ended_s = time.monotonic() - t0
        assert not alive, f"{fault}: ranks {[p.pid for p in alive]} still running after {EXIT_S} s"
        _, stderr = proc.communicate(timeout=30)
    lines = _our_lines(stderr)
    print(f"{fault}: every rank ended {ended_s:.2f} s after the fault; {lines}")
    assert len(lines) == 1, stderr[-5000:]
    if fault == "kill_trainer_rank_1":
        assert "rank 1 (pid" in lines[0], lines[0]
    else:  # the launcher got the signal, forwarded it, and says it
        assert lines[0] == f"torchtitan_rl: interrupted ({'SIGINT' if fault == 'sigint_group' else 'SIGTERM'})", lines[0]
    assert proc.returncode == {"sigint_group": 130, "sigterm_torchrun": 143, "kill_trainer_rank_1": 1}[fault]


def _environ(process: psutil.Process) -> str:
    return " ".join(f"{k}={v}" for k, v in process.environ().items() if k == "RANK")


@pytest.mark.slow
def test_collective_timeout_comes_from_the_config(tmp_path):
    """Two trainer ranks (the generator in rank 0's process): rank 1 waits for rank 0's slow step in a
    collective and gives up after trainer.collective_timeout_s, naming it; every rank ends."""
    t0 = time.monotonic()
    proc = _start(tmp_path, 2, "--trainer.steps", "2", "--trainer.collective_timeout_s", "3",
                  "--grpo.task", "tests.test_process_exits:slow_rank0_digits")
    with _reaped(proc):
        _, stderr = proc.communicate(timeout=SlowRank0Digits.SLOW_S + 120)
        ended_s = time.monotonic() - t0
    lines = _our_lines(stderr)
    assert proc.returncode != 0
    assert ended_s < SlowRank0Digits.SLOW_S, "the job waited for rank 0's slow step instead of timing out"
    assert len(lines) == 1, stderr[-5000:]
    assert lines[0].startswith("torchtitan_rl: rank 1 failed: "), lines[0]
    assert "trainer.collective_timeout_s" in lines[0] and "3000ms" in lines[0], lines[0]


@pytest.mark.slow  # a whole run or engine in its own process: 7-12 s, out of the quick loop
def test_a_user_error_on_every_rank_is_one_line_exit_2(tmp_path):
    """Every rank finds the same mistake (an export folder that is not empty): one line for the job, exit 2."""
    taken = tmp_path / "export"
    taken.mkdir()
    (taken / "model.safetensors").write_text("someone else's")
    proc = _start(tmp_path, 3, "--weight_sync.transport", "nccl", "--job.export_dir", str(taken))
    _, stderr = proc.communicate(timeout=120)
    lines = _our_lines(stderr)
    assert proc.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("torchtitan_rl: error: rank "), stderr[-3000:]
    assert f"export: {taken} exists and is not empty" in lines[0]
    assert proc.returncode == 2 and "ChildFailedError" not in stderr


@pytest.mark.slow  # torchrun start-up and a real engine: ~15 s
def test_a_rank_other_than_0_says_its_line_on_a_line_of_its_own(tmp_path):
    """Rank 1's user error mid-run, while rank 0's progress bar holds the shared stderr's last line open: the
    job's line still starts a line (it was glued to the bar's end, where a reader of the log misses it)."""
    proc = _start(tmp_path, 2, "--trainer.steps", "500", "--grpo.task", "tests.test_process_exits:rank1_refuses_later")
    with _reaped(proc):
        _, stderr = proc.communicate(timeout=120)
    lines = _our_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0] == "torchtitan_rl: error: rank 1: grpo.task: rank 1 refuses this prompt", lines[0]
    assert "it/s" in stderr, "rank 0's bar never showed a step: the case is not the one this test is for"
    assert proc.returncode == 2


@pytest.mark.slow  # a whole run or engine in its own process: 7-12 s, out of the quick loop
def test_torchrun_itself_adds_its_report_and_traceback(tmp_path):
    """Why the README launches with torchtitan_rl.launch: the same user error under torchrun ends in its
    ChildFailedError traceback (the ranks' line is there too, and the exit code is 1, not 2)."""
    taken = tmp_path / "export"
    taken.mkdir()
    (taken / "model.safetensors").write_text("someone else's")
    proc = _start(tmp_path, 2, "--job.export_dir", str(taken), launcher="torch.distributed.run")
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "ChildFailedError" in stderr and "exitcode  : 2" in stderr
    assert "Traceback" in stderr


@pytest.mark.slow  # a real engine's start-up: ~15 s
def test_sigterm_to_a_single_process_run_is_one_line_exit_143(tmp_path):
    env = repo_env(WORLD_SIZE=None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_rl.simple_grpo", "--config", str(CPU_TINY), "--job.output_dir",
         str(tmp_path), "--grpo.prompts_per_step", "8", "--trainer.steps", "500"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    with _reaped(proc):
        _wait_training(proc, tmp_path)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert _our_lines(stderr) == ["torchtitan_rl: interrupted (SIGTERM)"], stderr[-3000:]
    assert proc.returncode == 143


@pytest.mark.slow  # a real engine's start-up: ~15 s
def test_a_rank_killed_before_it_could_say_why_gets_one_line_from_the_launcher(tmp_path):
    """kill -9 of the only rank: nobody is left to say it, so the launcher names the rank and the signal."""
    proc = _start(tmp_path, 1, "--trainer.steps", "500")
    with _reaped(proc):
        _wait_training(proc, tmp_path)
        (rank,) = psutil.Process(proc.pid).children()
        rank.kill()
        _, stderr = proc.communicate(timeout=60)
    lines = _our_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith(f"torchtitan_rl: rank 0 (pid {rank.pid}) was killed by SIGKILL"), \
        stderr[-3000:]
    assert proc.returncode == 137


@pytest.mark.slow  # torchrun start-up and a real engine: 13-15 s
def test_a_user_error_rank_0_finds_ends_the_other_ranks_quietly(tmp_path):
    """--resume with nothing to resume: rank 0 says why; rank 1 exits 2 with no line and no traceback file."""
    out = tmp_path / "out"
    proc = _start(tmp_path, 2, "--job.output_dir", str(out), "--resume")
    _, stderr = proc.communicate(timeout=120)
    lines = _our_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("torchtitan_rl: error: rank 0: --resume: nothing to resume"), \
        stderr[-3000:]
    assert not out.exists()  # no error_rank1.txt with a SystemExit traceback
    assert proc.returncode == 2


def _lines_with_times(proc: subprocess.Popen) -> tuple[list[tuple[float, str]], float]:
    """Every non-empty line the process wrote (stdout and stderr merged; a progress bar's \\r ends a line), with the
    time it arrived, and the time the process ended."""
    lines, tail = [], b""
    while chunk := os.read(proc.stdout.fileno(), 65536):
        now = time.monotonic()
        *done, tail = (tail + chunk).replace(b"\r", b"\n").split(b"\n")
        lines += [(now, line.decode(errors="replace")) for line in done if line.strip()]
    proc.wait()
    if tail.strip():
        lines.append((time.monotonic(), tail.decode(errors="replace")))
    return lines, time.monotonic()


@pytest.mark.slow  # a real engine's start-up: ~15 s
def test_a_finished_run_exits_within_2_s_of_its_last_line(tmp_path):
    """The summary line is the last thing a run does: the engine shuts down before it, and the interpreter's
    teardown (3.9 s on this machine before: vLLM's and torch's finalizers) is skipped (run/exits.py)."""
    env = repo_env(WORLD_SIZE=None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchtitan_rl.simple_grpo", "--config", str(CPU_TINY), "--job.output_dir",
         str(tmp_path), "--grpo.prompts_per_step", "8", "--trainer.steps", "2"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    with _reaped(proc):
        lines, ended = _lines_with_times(proc)
    assert proc.returncode == 0, lines[-20:]
    last_at, last = lines[-1]
    assert last.startswith("torchtitan_rl: mean reward"), lines[-5:]
    assert ended - last_at < 2.0, ended - last_at


SLOW_IMPORT = '''
import os, sys, time


class _SlowImport:
    """Holds the import of one module (SLOW_IMPORT) for a minute, after leaving a file in SLOW_IMPORT_MARKS: a
    signal sent then lands while the process imports, as a Ctrl-C during torch's seconds-long import does."""

    def find_spec(self, name, path=None, target=None):
        ranks_only = os.environ.get("SLOW_IMPORT_RANKS_ONLY") and "TORCHELASTIC_RUN_ID" not in os.environ
        if name == os.environ.get("SLOW_IMPORT") and not ranks_only:
            open(os.path.join(os.environ["SLOW_IMPORT_MARKS"], str(os.getpid())), "w").close()
            time.sleep(60)
        return None


sys.meta_path.insert(0, _SlowImport())
'''


def _interrupted_while_importing(tmp_path: Path, module: str, cmd: list[str], *, marks: int = 1,
                                 ranks_only: bool = False) -> tuple[int, str]:
    """Start ``cmd`` with ``module``'s import held (a sitecustomize on its path), SIGINT its process group (a Ctrl-C)
    once ``marks`` processes are inside that import; (exit code, stderr)."""
    site, marks_dir = tmp_path / "site", tmp_path / "marks"
    site.mkdir()
    marks_dir.mkdir()
    (site / "sitecustomize.py").write_text(SLOW_IMPORT)
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}", "SLOW_IMPORT": module,
           "SLOW_IMPORT_MARKS": str(marks_dir)}
    if ranks_only:
        env["SLOW_IMPORT_RANKS_ONLY"] = "1"
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    with _reaped(proc):
        deadline = time.monotonic() + 120
        while len(list(marks_dir.iterdir())) < marks:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=30)
    return proc.returncode, stderr


def test_ctrl_c_while_the_launcher_imports_torch_is_one_line_exit_130(tmp_path):
    code, stderr = _interrupted_while_importing(tmp_path, "torch", [
        sys.executable, "-m", "torchtitan_rl.launch", "--nproc-per-node", "2", "-m", "torchtitan_rl.simple_grpo",
        "--config", str(CPU_TINY), "--job.output_dir", str(tmp_path / "out")])
    assert stderr == "torchtitan_rl: interrupted (SIGINT)\n", stderr[-3000:]
    assert code == 130


def test_ctrl_c_while_the_ranks_import_torch_is_one_line_exit_130(tmp_path):
    """The launcher runs (torchrun's agent), its two ranks are still importing torch: no rank's traceback, and the
    launcher's line."""
    code, stderr = _interrupted_while_importing(tmp_path, "torch", [
        sys.executable, "-m", "torchtitan_rl.launch", "--nproc-per-node", "2", "--master-port", str(free_port()),
        "-m", "torchtitan_rl.simple_grpo", "--config", str(CPU_TINY), "--job.output_dir", str(tmp_path / "out")],
        marks=2, ranks_only=True)
    assert _our_lines(stderr) == ["torchtitan_rl: interrupted (SIGINT)"], stderr[-3000:]
    assert code == 130


@pytest.mark.parametrize("module", ["tyro", "torch"])  # parsing the command line; train()'s first import
def test_ctrl_c_while_a_single_process_run_imports_is_one_line_exit_130(tmp_path, module):
    code, stderr = _interrupted_while_importing(tmp_path, module, [
        sys.executable, "-m", "torchtitan_rl.simple_grpo", "--config", str(CPU_TINY),
        "--job.output_dir", str(tmp_path / "out")])
    assert stderr == "torchtitan_rl: interrupted (SIGINT)\n", stderr[-3000:]
    assert code == 130
