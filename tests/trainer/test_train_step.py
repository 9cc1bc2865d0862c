"""train_step: direction of the update, accumulation, clipping, determinism."""

import dataclasses

import pytest
import torch

from torchtitan_rl.config.job_config import GRPOConfig, OptimizerConfig, ParallelismConfig

from .helpers import make_batch

pytestmark = pytest.mark.bf16_numerics

GRPO = GRPOConfig()


def _grads(trainer) -> dict[str, torch.Tensor]:
    return {k: p.grad.full_tensor() for k, p in trainer.model.named_parameters()}


def _grad_norm(trainer) -> float:
    return torch.linalg.vector_norm(torch.cat([g.flatten() for g in _grads(trainer).values()])).item()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_advantage_sign_moves_sequence_logprob(make_trainer, sign):
    trainer = make_trainer(optimizer=OptimizerConfig(lr=1e-2))
    batch = make_batch(seed=4, batch_size=2)
    mask_BL = batch.loss_mask_BL
    before_BL = trainer.token_logprobs(batch.tokens_BL, temperature=1.0)
    batch = dataclasses.replace(
        batch, old_logprobs_BL=before_BL * mask_BL, advantages_B=torch.tensor([sign, 0.0])
    )

    trainer.train_step(batch, temperature=1.0, grpo=GRPO)

    after_BL = trainer.token_logprobs(batch.tokens_BL, temperature=1.0)
    change = ((after_BL - before_BL) * mask_BL)[0].sum().item()
    assert sign * change > 0.05, change


def test_micro_batch_accumulation_matches_one_micro_batch(make_trainer):
    batch = make_batch(seed=5)
    whole = make_trainer(micro_batch_size=8, max_grad_norm=0.0)
    split = make_trainer(micro_batch_size=3, max_grad_norm=0.0)

    m_whole = whole.train_step(batch, temperature=1.0, grpo=GRPO)
    m_split = split.train_step(batch, temperature=1.0, grpo=GRPO)

    # The forward is bitwise the same per row; only fp32 sums change order, and
    # the bf16 weight gradients of 3+3+2 rows round differently from 8 rows.
    assert m_split["loss"] == pytest.approx(m_whole["loss"], rel=1e-6)  # fp32 sums reordered: ~1e-7 relative
    assert m_split["tokens"] == m_whole["tokens"]
    assert m_split["grad_norm"] == pytest.approx(m_whole["grad_norm"], rel=1e-3)  # bf16 steps (2e-3) averaged over the norm
    g_whole, g_split = _grads(whole), _grads(split)
    for name in g_whole:
        scale = g_whole[name].abs().max().item()
        # A few bf16 steps (2^-9 relative each) of the tensor's largest gradient, summed over 3 micro-batches.
        torch.testing.assert_close(g_split[name], g_whole[name], rtol=0, atol=1e-2 * scale)


def test_grad_norm_is_clipped_to_max_grad_norm(make_trainer):
    batch = make_batch(seed=6)
    clipped = make_trainer(max_grad_norm=1e-3)
    unclipped = make_trainer(max_grad_norm=0.0)

    m_clipped = clipped.train_step(batch, temperature=1.0, grpo=GRPO)
    m_unclipped = unclipped.train_step(batch, temperature=1.0, grpo=GRPO)

    # The metric is the norm before clipping; the gradients used are clipped.
    assert m_clipped["grad_norm"] == m_unclipped["grad_norm"] > 1e-2
    # fp32 gradients rescaled and re-summed: fp32 rounding only (1e-7 per op), a few orders of headroom.
    assert _grad_norm(clipped) == pytest.approx(1e-3, rel=1e-4)
    assert _grad_norm(unclipped) == pytest.approx(m_unclipped["grad_norm"], rel=1e-5)


def test_same_seed_and_batches_give_bitwise_identical_losses(make_trainer):
    def run() -> list[dict[str, float]]:
        trainer = make_trainer(micro_batch_size=3)
        return [
            trainer.train_step(make_batch(seed=s), temperature=0.9, grpo=GRPO) for s in (7, 8, 9)
        ]

    first, second = run(), run()
    assert first == second
    assert first[0]["loss"] != first[2]["loss"]


def test_metrics_and_step_counter(make_trainer):
    trainer = make_trainer()
    batch = make_batch(seed=10)
    batch = dataclasses.replace(batch, ref_logprobs_BL=batch.old_logprobs_BL - 0.1)

    metrics = trainer.train_step(
        batch, temperature=1.0, grpo=dataclasses.replace(GRPO, kl_coef=0.1)
    )

    assert set(metrics) >= {"loss", "grad_norm", "lr", "clip_fraction", "kl", "ratio_mean", "tokens"}
    assert metrics["tokens"] == batch.loss_mask_BL.sum().item()
    assert metrics["kl"] > 0 and 0 <= metrics["clip_fraction"] <= 1
    assert trainer.step == 1


def test_user_errors_name_the_field(make_trainer):
    with pytest.raises(ValueError, match="trainer.micro_batch_size"):
        make_trainer(micro_batch_size=0)
    with pytest.raises(ValueError, match="trainer.parallelism"):
        make_trainer(parallelism=ParallelismConfig(data_parallel_shard_degree=2))
    with pytest.raises(ValueError, match="trainer.parallelism.tensor_parallel_degree"):
        make_trainer(parallelism=ParallelismConfig(tensor_parallel_degree=0))
    trainer = make_trainer()
    with pytest.raises(ValueError, match="grpo.kl_coef"):
        trainer.train_step(
            make_batch(seed=11), temperature=1.0, grpo=dataclasses.replace(GRPO, kl_coef=0.1)
        )
    with pytest.raises(ValueError, match="temperature"):
        trainer.token_logprobs(make_batch(seed=11).tokens_BL, temperature=0.0)


def test_importance_weights_reach_the_loss(make_trainer):
    batch = make_batch(seed=12)
    plain = make_trainer(max_grad_norm=0.0).train_step(batch, temperature=1.0, grpo=GRPO)
    halved = make_trainer(max_grad_norm=0.0).train_step(
        dataclasses.replace(batch, is_weights_BL=torch.full_like(batch.old_logprobs_BL, 0.5)),
        temperature=1.0, grpo=GRPO,
    )
    # Same seed, same forward: halving every token's term is exact in binary floating point, in the loss
    # and in each bf16 gradient, so the norm halves bit for bit too.
    assert halved["loss"] == plain["loss"] / 2
    assert halved["grad_norm"] == plain["grad_norm"] / 2
