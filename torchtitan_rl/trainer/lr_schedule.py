"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay.

Written here rather than taken from torchtitan's LRSchedulersContainer: that
one wants an OptimizersContainer, has no "constant" decay and adds a virtual
last step; ours is one pure function of the step, wrapped in a LambdaLR.
"""

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from torchtitan_rl.config.job_config import LRSchedulerConfig


def lr_factor(step: int, *, config: LRSchedulerConfig, total_steps: int) -> float:
    """Multiplier of the peak lr for the optimizer step with 0-based index ``step``."""
    warmup = config.warmup_steps
    if step < warmup:
        # (step + 1) / warmup: the first step already learns; step warmup-1 is at peak.
        return (step + 1) / warmup
    if config.decay == "constant":
        return 1.0
    # From the peak at the first step after warmup to min_lr_ratio at the last step.
    decay_steps = max(total_steps - warmup - 1, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    if config.decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, config: LRSchedulerConfig, *, total_steps: int
) -> LambdaLR:
    """A LambdaLR that sets the lr of optimizer step i to peak * lr_factor(i)."""
    return LambdaLR(
        optimizer, lambda step: lr_factor(step, config=config, total_steps=total_steps)
    )
