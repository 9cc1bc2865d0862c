"""Test data for the trainer tests."""

import torch

from torchtitan_rl.trainer import TrainBatch, checkpoint

VOCAB = 16
"""Vocabulary of the tiny test model."""


def make_batch(*, seed: int, batch_size: int = 8, prompt_len: int = 5, seq_len: int = 12) -> TrainBatch:
    """Random prompts + completions of random length, right-padded with 0."""
    g = torch.Generator().manual_seed(seed)
    tokens_BL = torch.randint(1, VOCAB, (batch_size, seq_len), generator=g)
    ends_B = torch.randint(prompt_len + 1, seq_len + 1, (batch_size,), generator=g)
    positions_L = torch.arange(seq_len)
    in_completion_BL = (positions_L >= prompt_len) & (positions_L < ends_B[:, None])
    tokens_BL = torch.where(positions_L < ends_B[:, None], tokens_BL, 0)
    mask_BL = in_completion_BL.float()
    # Logprobs near the tiny model's (~ -log 16) so ratios start close to 1.
    old_BL = (-2.77 + 0.05 * torch.randn(batch_size, seq_len, generator=g)) * mask_BL
    return TrainBatch(
        tokens_BL=tokens_BL,
        loss_mask_BL=mask_BL,
        old_logprobs_BL=old_BL,
        advantages_B=torch.randn(batch_size, generator=g),
    )


def load_newest(trainer) -> dict | None:
    """Restore the trainer's newest checkpoint that verifies (as run.plan.plan_run picks it); its extra, or None."""
    found = checkpoint.newest_verified(trainer.checkpoint_folder)
    return None if found is None else trainer.load_checkpoint(found[1])
