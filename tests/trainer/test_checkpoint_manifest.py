"""Checkpoints prove themselves: each kind of damage falls back to the previous checkpoint with one line,
pruning never deletes what it did not write before, and a resume trains with the config's optimizer settings."""

import re
import shutil

import pytest

from torchtitan_rl.config.job_config import CheckpointConfig, GRPOConfig, OptimizerConfig
from torchtitan_rl.trainer import checkpoint

from .helpers import load_newest, make_batch


def _step(trainer, seed: int) -> dict[str, float]:
    return trainer.train_step(make_batch(seed=seed), temperature=1.0, grpo=GRPOConfig())


def _truncate(path):
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])


def _zero_bytes(path):
    # One tensor's bytes zeroed in place: the size is unchanged, torch would load it without a word.
    shard = path / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 3: len(data) // 3 + 4096] = bytes(4096)
    shard.write_bytes(bytes(data))


def _garbage_metadata(path):
    (path / ".metadata").write_bytes(b"\x80garbage" * 100)


def _half_pruned(path):
    # What a kill during the old pruning (rmtree) left: only .metadata.
    for f in path.iterdir():
        if f.name != ".metadata":
            f.unlink()


DAMAGE = {
    "truncated shard": (_truncate, "__0_0.distcp has .* bytes, the manifest says"),
    "deleted shard": (lambda p: (p / "__0_0.distcp").unlink(), "__0_0.distcp is missing"),
    "zeroed bytes, same size": (_zero_bytes, r"__0_0.distcp does not match its checksum"),
    "garbage .metadata": (_garbage_metadata, r".metadata (has .* bytes|does not match its checksum)"),
    "deleted .metadata": (lambda p: (p / ".metadata").unlink(), ".metadata is missing"),
    "half-pruned": (_half_pruned, "no manifest.json"),
    "manifest garbage": (lambda p: (p / "manifest.json").write_text("{not json"), "manifest.json unreadable"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_checkpoint_is_skipped_with_one_line(make_trainer, tmp_path, capsys, kind):
    damage, reason = DAMAGE[kind]
    trainer = make_trainer(checkpoint=CheckpointConfig(keep_latest=0))
    for step in (1, 2):
        _step(trainer, step)
        trainer.save_checkpoint(step, extra={"step": step})
    damage(tmp_path / "checkpoints" / "step-2")
    capsys.readouterr()

    resumed = make_trainer()
    assert load_newest(resumed) == {"step": 1}
    assert resumed.step == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"torchtitan_rl: skipping checkpoint {tmp_path / 'checkpoints' / 'step-2'}: ")
    assert re.search(reason, lines[0]), lines[0]


def test_a_checkpoint_without_a_good_manifest_never_loads(make_trainer, tmp_path):
    trainer = make_trainer()
    _step(trainer, 0)
    trainer.save_checkpoint(1)
    _zero_bytes(tmp_path / "checkpoints" / "step-1")
    assert load_newest(make_trainer()) is None


def test_pruning_keeps_checkpoints_newer_than_the_one_it_saved(make_trainer, tmp_path):
    # Another lineage's step-10 and step-20 (a run that got further) sit in the folder: a save of step 1
    # keeping one checkpoint deletes neither of them, nor its own step-1.
    other = make_trainer(output_dir=tmp_path / "other", checkpoint=CheckpointConfig(keep_latest=0))
    _step(other, 0)
    for step in (10, 20):
        other.save_checkpoint(step)
        shutil.copytree(tmp_path / "other" / "checkpoints" / f"step-{step}", tmp_path / "checkpoints" / f"step-{step}")
    trainer = make_trainer(checkpoint=CheckpointConfig(keep_latest=1))
    _step(trainer, 1)
    trainer.save_checkpoint(1)
    _step(trainer, 2)
    trainer.save_checkpoint(2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-10", "step-2", "step-20"]


def test_prune_renames_before_deleting(make_trainer, tmp_path):
    # A step-N.trash (a prune killed mid-delete) is never loaded, and the next save clears it.
    trainer = make_trainer(checkpoint=CheckpointConfig(keep_latest=1))
    _step(trainer, 0)
    trainer.save_checkpoint(1, extra={"step": 1})
    trainer.save_checkpoint(3, extra={"step": 3})
    folder = tmp_path / "checkpoints"
    (folder / "step-3").rename(folder / "step-3.trash")
    assert load_newest(make_trainer()) is None  # step-1 was pruned; step-3.trash does not count
    trainer.save_checkpoint(4)
    assert sorted(p.name for p in folder.iterdir()) == ["step-4"]
    assert checkpoint.verify(folder / "step-4") is None


def test_resume_trains_with_the_configs_optimizer_settings(make_trainer):
    run = make_trainer(optimizer=OptimizerConfig(lr=3e-3), steps=10)
    for seed in (0, 1):
        _step(run, seed)
    run.save_checkpoint(2)
    assert _step(run, 2)["lr"] == 3e-3

    resumed = make_trainer(optimizer=OptimizerConfig(lr=1e-4, weight_decay=0.1), steps=10)
    load_newest(resumed)
    assert _step(resumed, 2)["lr"] == 1e-4
    group = resumed.optimizer.param_groups[0]
    assert group["weight_decay"] == 0.1 and group["initial_lr"] == 1e-4
    assert resumed.scheduler.last_epoch == 3
