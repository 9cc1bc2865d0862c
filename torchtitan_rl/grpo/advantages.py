"""Group-relative advantages: each completion is scored against its siblings.

GRPO needs no value network: the baseline for a completion is the mean
reward of the other completions sampled for the same prompt.
"""

from typing import Literal

import torch
from torch import Tensor


def group_advantages(
    rewards_B: Tensor,
    *,
    group_size: int,
    norm: Literal["group_std", "none"],
    eps: float = 1e-6,
) -> Tensor:
    """Per-completion advantages from rewards laid out group-contiguously.

    ``rewards_B`` has B = prompts * group_size entries; entries
    ``[g * group_size, (g + 1) * group_size)`` are the completions of prompt g.

    norm="group_std" returns (r - mean_g) / (std_g + eps); "none" returns
    r - mean_g. std is the population std (divide by G, not G - 1): it is
    defined for every G (the unbiased one is NaN for G = 1), and it makes the
    advantages of a non-degenerate group exactly unit-variance, so the loss
    scale does not depend on the group size convention.

    A group whose rewards are all identical carries no signal about which
    completion is better; its advantages are exactly 0 (not eps-sized noise
    from rounding in the mean).
    """
    if group_size < 1:
        raise ValueError(f"grpo.group_size must be >= 1, got {group_size}")
    if norm not in ("group_std", "none"):
        raise ValueError(f"grpo.advantage_norm must be 'group_std' or 'none', got {norm!r}")
    assert rewards_B.ndim == 1, f"rewards must be 1-D, got shape {tuple(rewards_B.shape)}"
    assert rewards_B.numel() % group_size == 0, (
        f"{rewards_B.numel()} rewards do not split into groups of {group_size}"
    )
    rewards_PG = rewards_B.float().view(-1, group_size)
    advantages_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if norm == "group_std":
        std_P1 = rewards_PG.std(dim=1, unbiased=False, keepdim=True)
        advantages_PG = advantages_PG / (std_P1 + eps)
    identical_P1 = (rewards_PG == rewards_PG[:, :1]).all(dim=1, keepdim=True)
    advantages_PG = torch.where(identical_P1, 0.0, advantages_PG)
    return advantages_PG.view(-1)
