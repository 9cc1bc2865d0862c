"""LR schedule: linear warmup, then constant, linear or cosine decay to min_lr_ratio."""

import math

import pytest
import torch

from torchtitan_rl.config.job_config import GRPOConfig, LRSchedulerConfig
from torchtitan_rl.trainer.lr_schedule import build_lr_scheduler, lr_factor

from .helpers import make_batch


def _factors(total_steps: int, **fields) -> list[float]:
    config = LRSchedulerConfig(**fields)
    return [lr_factor(s, config=config, total_steps=total_steps) for s in range(total_steps)]


def test_warmup_is_linear_and_reaches_peak():
    assert _factors(6, warmup_steps=4) == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_ends_at_min_lr_ratio():
    f = _factors(7, warmup_steps=2, decay="linear", min_lr_ratio=0.1)
    assert f[:3] == [0.5, 1.0, 1.0]  # peak at the last warmup step and the first after
    assert f[-1] == pytest.approx(0.1)
    diffs = [a - b for a, b in zip(f[2:], f[3:])]
    assert all(d == pytest.approx(diffs[0]) for d in diffs)  # straight line


def test_cosine_decay_shape():
    f = _factors(11, decay="cosine", min_lr_ratio=0.0)
    assert f[0] == 1.0 and f[-1] == pytest.approx(0.0, abs=1e-12)
    assert f[5] == pytest.approx(0.5)  # half way down the half cosine
    assert f[1] == pytest.approx(0.5 * (1 + math.cos(math.pi / 10)))


def test_scheduler_sets_optimizer_lr_per_step():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.AdamW([param], lr=2.0)
    scheduler = build_lr_scheduler(
        optimizer, LRSchedulerConfig(warmup_steps=2, decay="linear"), total_steps=4
    )
    lrs = []
    for _ in range(4):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([1.0, 2.0, 2.0, 0.0])


def test_trainer_reports_the_lr_of_each_step(make_trainer):
    trainer = make_trainer(steps=3, lr_scheduler=LRSchedulerConfig(warmup_steps=2))
    lrs = [
        trainer.train_step(make_batch(seed=s), temperature=1.0, grpo=GRPOConfig())["lr"]
        for s in range(3)
    ]
    peak = trainer.config.optimizer.lr
    assert lrs == pytest.approx([peak / 2, peak, peak])
