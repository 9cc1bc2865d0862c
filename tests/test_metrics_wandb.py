"""Weights & Biases as an optional logger: offline, no network, absent from the default install."""

import pytest

from torchtitan_rl.config import WandbConfig
from torchtitan_rl.run.metrics import MetricsLogger


def test_wandb_offline_run_records_scalars_and_samples(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # the [wandb] extra
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, enabled=True)
    logger.attach_wandb(WandbConfig(project="torchtitan_rl_test"), run_config={"grpo": {"epochs": 2}}, name="t")
    logger.log(0, {"reward_mean": 0.5, "loss": 0.1, "mismatch_mean": 0.0, "mismatch_max": 0.0})
    logger.log_samples(0, [{"prompt": "1+1?", "completion": "2", "reward": 1.0, "correct": True, "version": 0}])
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))  # `wandb sync` uploads this later


def test_without_wandb_installed_asking_for_it_is_one_line(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError, as without the extra
    logger = MetricsLogger(tmp_path, enabled=True)
    with pytest.raises(ValueError, match=r"^metrics.wandb.project: wandb is not installed"):
        logger.attach_wandb(WandbConfig(project="p"))
    logger.close()
