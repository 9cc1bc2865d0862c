"""Rows of 8k-16k tokens (a reasoning run's long samples) through the trainer's memory savers: micro-batches
cut by tokens, activation checkpointing and chunked logprobs give the plain path's loss and gradients."""

import pytest
import torch

from torchtitan_rl.config.job_config import GRPOConfig, TrainerConfig
from torchtitan_rl.models.families import resolve_shape
from torchtitan_rl.trainer import TrainBatch, Trainer
from torchtitan_rl.trainer.micro_batches import plan, row_lengths

from .helpers import VOCAB
from .test_train_step import FP32, _assert_same_step

PROMPT = 64
LENGTHS = (PROMPT + 16384, PROMPT + 300)
"""Prompt + completion of each row: a capped 16k sample and a short one."""


def _batch() -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    L = max(LENGTHS)
    tokens_BL = torch.randint(1, VOCAB, (len(LENGTHS), L), generator=g)
    positions_L = torch.arange(L)
    ends_B = torch.tensor(LENGTHS)
    tokens_BL = torch.where(positions_L < ends_B[:, None], tokens_BL, 0)
    mask_BL = ((positions_L >= PROMPT) & (positions_L < ends_B[:, None])).float()
    return TrainBatch(tokens_BL=tokens_BL, loss_mask_BL=mask_BL, old_logprobs_BL=-2.77 * mask_BL,
                      advantages_B=torch.tensor([1.0, -0.5]))


@pytest.mark.slow  # a 16k row twice (once with every block recomputed) in fp32
def test_16k_rows_through_token_budget_checkpointing_and_chunks_match_the_plain_path(tmp_path):
    shape = resolve_shape(flavor="tiny", hf_checkpoint=None, vocab_size=VOCAB, max_seq_len=max(LENGTHS))
    batch = _batch()
    budget = max(LENGTHS)  # what validation allows at least: generator.max_model_len
    # the 16k row fills the budget alone
    assert [len(mb.rows) for mb in plan(row_lengths(batch.loss_mask_BL), max_rows=512, max_tokens=budget)] == [1, 1]

    def trainer(**fields) -> Trainer:
        return Trainer(TrainerConfig(max_grad_norm=0.0, **fields), model_config=FP32, shape=shape, seed=0,
                       device=torch.device("cpu"), output_dir=tmp_path)

    plain = trainer(micro_batch_size=1, logprob_chunk_tokens=0)  # each row alone: no 16k of padding to compute
    saving = trainer(micro_batch_size=512, micro_batch_tokens=budget, logprob_chunk_tokens=2048,
                     activation_checkpoint="full")
    m_plain = plain.train_step(batch, temperature=1.0, grpo=GRPOConfig())
    m_saving = saving.train_step(batch, temperature=1.0, grpo=GRPOConfig())
    assert m_plain["tokens"] == 16384 + 300
    _assert_same_step(saving, plain, m_saving, m_plain)
