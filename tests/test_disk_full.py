"""A full or read-only disk ends a command with one line naming the path and its free space, and loses nothing.

Caused for real: a small tmpfs mounted for the test and filled by a task whose
reward writes a file until the kernel says ENOSPC (mid-run, at a chosen step)
or remounts it read-only, and a read-only bind mount (root ignores chmod). All
need root's mount(8): the tests skip where the sandbox forbids it.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, free_port, repo_env, run_cli, run_module
from torchtitan_rl import simple_grpo
from torchtitan_rl.config import load_toml
from torchtitan_rl.export import export_hf
from torchtitan_rl.grpo.tasks.digits import DigitsTask
from torchtitan_rl.trainer import checkpoint

CPU_TINY = REPO / "run_configs" / "cpu_tiny.toml"
FILL_AT_STEP = 2
"""The filling task fills the disk during this step's rewards."""


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount {' '.join(args)}: {proc.stderr.strip()} (needs root in a sandbox that allows mounts)")


@pytest.fixture
def small_disk(tmp_path):
    """Factory: a tmpfs of ``mib`` MiB at tmp_path/disk, unmounted after the test."""
    disk = tmp_path / "disk"
    disk.mkdir()

    def make(mib: int) -> Path:
        _mount("-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(disk))
        return disk

    yield make
    subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.fixture
def read_only(tmp_path):
    """A read-only bind mount of an empty folder."""
    source, target = tmp_path / "source", tmp_path / "read_only"
    source.mkdir()
    target.mkdir()
    _mount("--bind", str(source), str(target))
    try:
        _mount("-o", "remount,ro,bind", str(target))
        yield target
    finally:
        subprocess.run(["umount", str(target)], capture_output=True)


def fill(disk: Path, *, leave: int) -> None:
    """Write disk/filler until the file system refuses, then give back ``leave`` bytes."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 65536)
        except OSError:
            pass
    with open(disk / "filler", "ab") as f:
        f.truncate(max(0, (disk / "filler").stat().st_size - leave))


class FillingDigits(DigitsTask):
    """The digits task, whose first reward of step FILL_AT_STEP (once metrics.jsonl holds the earlier steps'
    lines) fills $FILL_DISK, leaving $FILL_LEAVE bytes."""

    def __init__(self) -> None:
        super().__init__(mode="copy")
        self.filled = False

    def reward(self, prompt, completion_ids):
        disk = Path(os.environ["FILL_DISK"])
        metrics = disk / "out" / "latest" / "metrics.jsonl"
        if not self.filled and metrics.is_file() and len(metrics.read_text().splitlines()) >= FILL_AT_STEP:
            fill(disk, leave=int(os.environ["FILL_LEAVE"]))
            self.filled = True
        return super().reward(prompt, completion_ids)


def filling_digits() -> FillingDigits:
    return FillingDigits()


def _run_until_full(monkeypatch, disk: Path, *extra: str, leave: int):
    """A 4-step cpu_tiny run into disk/out whose step FILL_AT_STEP fills the disk."""
    monkeypatch.setenv("FILL_DISK", str(disk))
    monkeypatch.setenv("FILL_LEAVE", str(leave))
    return run_module("torchtitan_rl.simple_grpo", "--config", str(CPU_TINY), "--job.output_dir", str(disk / "out"),
                      "--trainer.steps", "4", "--grpo.prompts_per_step", "8",
                      "--grpo.task", "tests.test_disk_full:filling_digits", *extra, timeout=240)


def _one_line(proc) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("torchtitan_rl:") or "Error" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def _metrics_steps(run: Path) -> list[int]:
    text = (run / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    return [json.loads(line)["step"] for line in text.splitlines()]  # every line whole


@pytest.mark.slow  # a real run to its third step (vLLM's start-up): 25-50 s on 2 shared cores
def test_a_checkpoint_save_on_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(small_disk, monkeypatch):
    disk = small_disk(16)
    proc = _run_until_full(monkeypatch, disk, "--trainer.checkpoint.enable", "--trainer.checkpoint.interval", "1",
                           "--trainer.checkpoint.keep_latest", "1", leave=256 << 10)
    run = disk / "out" / "run-1"
    line = _one_line(proc)
    assert line.startswith(f"torchtitan_rl: error: {run / 'checkpoints'}: no space left while saving step-3 ("), line
    assert "free there); step-3.tmp removed, step-2 still verifies and --resume continues from it" in line, line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2"]
    assert checkpoint.verify(run / "checkpoints" / "step-2") is None
    assert _metrics_steps(run) == [0, 1, 2]
    assert (disk / "out" / "latest").resolve() == run


@pytest.mark.slow  # a real run to its third step (vLLM's start-up): 25-50 s on 2 shared cores
def test_metrics_on_a_full_disk_are_one_line_and_keep_every_whole_line(small_disk, monkeypatch):
    disk = small_disk(8)
    proc = _run_until_full(monkeypatch, disk, leave=0)
    run = disk / "out" / "run-1"
    line = _one_line(proc)
    assert line.startswith(f"torchtitan_rl: error: {run}/"), line
    failed = re.search(r"no space left while writing step (\d+)'s metrics \(", line)
    assert failed and "free there)" in line, line
    # Step 2's line too when the page it went into had room; then TensorBoard's events failed at step 2, or,
    # buffered, step 3's line did.
    steps = _metrics_steps(run)
    assert (steps, int(failed[1])) in (([0, 1], 2), ([0, 1, 2], 2), ([0, 1, 2], 3)), (steps, line)


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_no_partial_folder(small_disk):
    from tests.helpers import tiny_shape
    from torchtitan_rl.models.shape import build_titan_model

    disk = small_disk(1)
    fill(disk, leave=64 << 10)
    shape = tiny_shape()
    model = build_titan_model(shape, seed=0)
    with pytest.raises(ValueError) as e:
        export_hf(dict(model.named_parameters()), shape=shape, out_dir=disk / "hf")
    message = str(e.value)
    assert message.startswith(f"{disk / 'hf'}: no space left while exporting (") and "\n" not in message, message
    assert "free there); nothing written there (hf.partial removed)" in message
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]


EXPORT_ROOM = 160 << 10
"""What the filling task leaves: room for the last steps' metrics and the plot, not for the cpu_tiny export
(~270 KiB: 243 KiB of bf16 weights, its tokenizer and config)."""


@pytest.mark.slow  # a real 4-step run (vLLM's start-up): 25-50 s on 2 shared cores
def test_a_run_without_checkpoints_exports_onto_a_disk_that_filled_during_the_run(small_disk, monkeypatch):
    """The export's room is reserved when the run starts (disk.reserve): a disk that fills during the run still
    takes the export, and the trained weights are not lost (before: 'no space left while exporting', no
    checkpoint anywhere)."""
    from safetensors.torch import load_file

    from torchtitan_rl.export import _expected_hf_shapes
    from torchtitan_rl.models.families import shape_from_hf_config

    disk = small_disk(8)
    proc = _run_until_full(monkeypatch, disk, "--job.export", leave=EXPORT_ROOM)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = disk / "out" / "run-1"
    assert sorted(p.name for p in run.iterdir() if p.name.startswith("hf")) == ["hf"]  # no hf.partial left
    shape = shape_from_hf_config(json.loads((run / "hf" / "config.json").read_text()), where="test")
    tensors = load_file(run / "hf" / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == _expected_hf_shapes(shape)
    assert _metrics_steps(run) == [0, 1, 2, 3]
    assert (disk / "filler").stat().st_size > 0  # the disk was full while the run went on


@pytest.mark.slow  # the trainer and vLLM start before the room is reserved: ~20 s on 2 shared cores
def test_a_run_that_exports_onto_a_disk_without_room_for_it_is_refused_before_it_trains(small_disk):
    disk = small_disk(2)
    fill(disk, leave=EXPORT_ROOM)
    proc = run_module("torchtitan_rl.simple_grpo", "--config", str(CPU_TINY), "--job.output_dir", str(disk / "out"),
                      "--trainer.steps", "2", "--grpo.prompts_per_step", "8", "--job.export", timeout=240)
    run = disk / "out" / "run-1"
    line = _one_line(proc)
    assert line.startswith(f"torchtitan_rl: error: {run / 'hf'}: no space left while reserving the "), line
    assert " its export will take (" in line and "free there); nothing trained; free space there or pick another " \
        "--job.export_dir [this start left " in line, line
    assert not (run / "metrics.jsonl").exists() and not (run / "hf.partial").exists()


class FreezingDigits(DigitsTask):
    """The digits task, whose reward remounts $FREEZE_DISK read-only during the last step (metrics.jsonl in
    $FREEZE_RUN holds $FREEZE_AT lines): the export's reserved room is then there but cannot be written."""

    def __init__(self) -> None:
        super().__init__(mode="copy")
        self.frozen = False

    def reward(self, prompt, completion_ids):
        metrics = Path(os.environ["FREEZE_RUN"]) / "metrics.jsonl"
        if not self.frozen and metrics.is_file() and len(metrics.read_text().splitlines()) >= int(
                os.environ["FREEZE_AT"]):
            subprocess.run(["mount", "-o", "remount,ro", os.environ["FREEZE_DISK"]], check=True)
            self.frozen = True
        return super().reward(prompt, completion_ids)


def freezing_digits() -> FreezingDigits:
    return FreezingDigits()


@pytest.mark.slow  # a real 3-step run, then the export command: 30-60 s on 2 shared cores
def test_a_failed_end_of_run_export_names_the_checkpoint_and_the_command_that_exports_it(
        small_disk, tmp_path, monkeypatch):
    """Whatever still refuses the export (here its file system turned read-only mid-run), the line says where
    the trained weights are and the exact command; that command then writes the export (before: 'the run's
    checkpoints are untouched' whether or not there were any)."""
    from safetensors.torch import load_file

    disk = small_disk(4)
    run = tmp_path / "out" / "run-1"
    monkeypatch.setenv("FREEZE_DISK", str(disk))
    monkeypatch.setenv("FREEZE_RUN", str(run))
    monkeypatch.setenv("FREEZE_AT", "2")
    proc = run_module("torchtitan_rl.simple_grpo", "--config", str(CPU_TINY), "--job.output_dir", str(tmp_path / "out"),
                      "--trainer.steps", "3", "--grpo.prompts_per_step", "8", "--job.export_dir", str(disk / "hf"),
                      "--trainer.checkpoint.enable", "--trainer.checkpoint.interval", "3",
                      "--grpo.task", "tests.test_disk_full:freezing_digits", timeout=240)
    line = _one_line(proc)
    step = run / "checkpoints" / "step-3"
    assert line.startswith(f"torchtitan_rl: error: {disk / 'hf'}: read-only file system while exporting ("), line
    command = f"python -m torchtitan_rl.export --run-dir {run} --step 3 --out DIR"
    assert line.endswith(f"nothing written there (hf.partial could not be removed); the trained weights are in "
                         f"{step}, which verifies: `{command}` exports it"), line
    out = tmp_path / "later"
    proc = subprocess.run(command.replace("DIR", str(out)).replace("python", sys.executable, 1).split(), cwd=REPO,
                          env=repo_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert load_file(out / "model.safetensors")


def test_a_failed_export_of_a_run_without_checkpoints_says_the_weights_are_lost(tmp_path):
    from torchtitan_rl.export import weights_left

    cfg = load_toml(CPU_TINY)
    assert weights_left(tmp_path, cfg) == ("the trained weights are lost: the run saved no checkpoint "
                                          "(--trainer.checkpoint.enable keeps them)")


def test_dry_run_into_a_read_only_folder_is_one_line(read_only):
    proc = run_cli("--config", str(CPU_TINY), "--job.output_dir", str(read_only / "out"), "--dry-run")
    line = _one_line(proc)
    assert line.startswith(f"torchtitan_rl: error: {read_only / 'out' / 'dry-run.toml'}: read-only file system "
                           "while writing the resolved config ("), line
    assert "free there); the config is valid" in line


def test_a_run_into_a_read_only_folder_is_one_line(read_only):
    cfg = load_toml(CPU_TINY)
    cfg.job.output_dir = str(read_only / "out")
    with pytest.raises(ValueError) as e:
        simple_grpo.train(cfg)  # refused before any engine starts
    assert str(e.value).startswith(f"{read_only / 'out'}: read-only file system while creating the run folder ("), \
        str(e.value)


@pytest.mark.slow  # two ranks: ~10 s
def test_a_two_rank_checkpoint_save_on_a_full_disk_ends_every_rank_with_the_same_verdict(small_disk, tmp_path):
    """FSDP over 2 ranks, each writing its own shard: whichever rank the disk refuses, every rank leaves the
    save (no rank waits in a barrier for the others), step-N.tmp goes, and the previous checkpoint verifies."""
    disk = small_disk(3)  # room for one checkpoint of the tiny model with Adam state (1.7 MiB), not two
    results = tmp_path / "results"
    results.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(REPO / "tests" / "trainer" / "full_disk_worker.py"), str(disk / "out"), str(results)]
    proc = subprocess.run(cmd, cwd=REPO, env=repo_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = disk / "out" / "checkpoints"
    ended = [(results / f"rank{r}.txt").read_text() for r in range(2)]
    kept = sorted(p.name for p in folder.iterdir())
    assert len(kept) == 1 and kept[0].startswith("step-") and checkpoint.verify(folder / kept[0]) is None, kept
    failed = f"step-{int(kept[0].removeprefix('step-')) + 1}"
    assert all(e.startswith(("ValueError: ", "SystemExit: ")) for e in ended), ended
    for e in ended:
        if e.startswith("ValueError"):
            assert e.startswith(f"ValueError: {folder}: no space left while saving {failed} ("), e
            assert e.endswith(f"{failed}.tmp removed, {kept[0]} still verifies and --resume continues from it"), e
