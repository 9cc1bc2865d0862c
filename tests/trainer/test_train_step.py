"""train_step: direction of the update, accumulation, clipping, determinism."""

import dataclasses

import pytest
import torch

from torchtitan_rl.config.job_config import GRPOConfig, LoRAConfig, ModelConfig, OptimizerConfig, ParallelismConfig

from torchtitan_rl.grpo.batch import logprob_mismatch
from torchtitan_rl.grpo.loss import importance_weights

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


# fp32 compute for comparisons across micro-batch layouts: rows are sorted by length and each
# micro-batch is cut to its longest row, so a row meets GEMMs and attention of other shapes, and
# bf16 kernels may round its logits differently by shape (torch's AVX2 kernels do, by ~1e-3 in a
# logprob). In fp32 only the order of sums changes: measured <= 2e-7 relative in the loss and
# <= 1e-6 of a tensor's largest gradient element (AVX512 and AVX2), so the bounds below hold 10x.
FP32 = ModelConfig(dtype="float32")
LOSS_RTOL = 2e-6
GRAD_RTOL = 1e-5


def _assert_same_step(got, want, m_got, m_want):
    assert m_got["tokens"] == m_want["tokens"]
    assert m_got["loss"] == pytest.approx(m_want["loss"], rel=LOSS_RTOL)
    assert m_got["grad_norm"] == pytest.approx(m_want["grad_norm"], rel=GRAD_RTOL)
    g_got, g_want = _grads(got), _grads(want)
    assert g_got.keys() == g_want.keys()
    for name in g_want:
        scale = g_want[name].abs().max().item()
        torch.testing.assert_close(g_got[name], g_want[name], rtol=0, atol=GRAD_RTOL * scale)


def test_micro_batch_accumulation_matches_one_micro_batch(make_trainer):
    batch = make_batch(seed=5)
    whole = make_trainer(micro_batch_size=8, max_grad_norm=0.0, model_config=FP32)
    split = make_trainer(micro_batch_size=3, max_grad_norm=0.0, model_config=FP32)

    m_whole = whole.train_step(batch, temperature=1.0, grpo=GRPO)
    m_split = split.train_step(batch, temperature=1.0, grpo=GRPO)

    _assert_same_step(split, whole, m_split, m_whole)


@pytest.mark.parametrize(
    "fields",
    [
        {"logprob_chunk_tokens": 5},  # chunks that split rows
        {"micro_batch_tokens": 20, "logprob_chunk_tokens": 7},  # 1-3 rows per micro-batch by length
        {"micro_batch_size": 3, "activation_checkpoint": "full"},
    ],
)
def test_chunked_logprobs_token_budget_and_checkpointing_match_the_plain_path(make_trainer, fields):
    batch = make_batch(seed=5, batch_size=8, seq_len=16)
    plain = make_trainer(micro_batch_size=8, logprob_chunk_tokens=0, max_grad_norm=0.0, model_config=FP32)
    other = make_trainer(max_grad_norm=0.0, model_config=FP32, **fields)

    m_plain = plain.train_step(batch, temperature=0.8, grpo=GRPO)
    m_other = other.train_step(batch, temperature=0.8, grpo=GRPO)

    _assert_same_step(other, plain, m_other, m_plain)
    assert set(other.sync_state()) == set(plain.sync_state())  # checkpointing renames nothing


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
    with pytest.raises(ValueError, match="trainer.micro_batch_tokens"):
        make_trainer(micro_batch_tokens=-1)
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


@pytest.mark.parametrize("ratio_level, correction", [("token", "off"), ("sequence", "off"), ("token", "truncate"),
                                                      ("sequence", "mask")])
def test_pi_old_from_the_training_forward_equals_the_recompute(make_trainer, ratio_level, correction):
    """grpo.old_logprobs train: no recompute; the step (importance weights included) and the gap to the generator's
    logprobs come out as with it."""
    batch = make_batch(seed=13)
    grpo = GRPOConfig(ratio_level=ratio_level, importance_correction=correction, importance_cap=1.01)
    fp32 = ModelConfig(dtype="float32")  # the recompute's batch shapes differ from training's: fp32 keeps them equal
    recomputing = make_trainer(micro_batch_size=3, model_config=fp32)
    old_BL = recomputing.token_logprobs(batch.tokens_BL, temperature=1.0) * batch.loss_mask_BL
    noise_BL = 0.02 * torch.randn(old_BL.shape, generator=torch.Generator().manual_seed(0))
    generator_BL = (old_BL + noise_BL) * batch.loss_mask_BL  # what a generator reports, near the trainer's
    weights_BL, rho = importance_weights(old_BL, generator_BL, batch.loss_mask_BL, mode=correction, cap=1.01,
                                         level=ratio_level)  # as the builder weighs with the recompute
    want = recomputing.train_step(dataclasses.replace(batch, old_logprobs_BL=old_BL, is_weights_BL=weights_BL),
                                  temperature=1.0, grpo=grpo)
    got = make_trainer(micro_batch_size=3, model_config=fp32).train_step(
        dataclasses.replace(batch, old_logprobs_BL=None, generator_logprobs_BL=generator_BL), temperature=1.0,
        grpo=grpo)
    # pi_old is the recompute's up to fp32 summation order, so the step is too.
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
    assert got["ratio_mean"] == 1.0 and got["clip_fraction"] == 0.0  # exactly: the ratio of a forward to itself
    mismatch = logprob_mismatch(old_BL, generator_BL, batch.loss_mask_BL)
    assert correction == "off" or 0 < rho["is_capped_frac"] < 1  # a cap of 1.01 acts on some tokens, not all
    for key, value in (mismatch | rho).items():
        assert got[key] == pytest.approx(value, rel=1e-4), key  # gaps of ~1e-2 measured on fp32 logprobs
    assert "mismatch_mean" not in want  # the recompute's are the builder's to report


def test_epochs_move_the_ratio_off_one_and_clipping_engages(make_trainer):
    batch = make_batch(seed=11)
    trainer = make_trainer(optimizer=OptimizerConfig(lr=3e-2))
    batch = dataclasses.replace(
        batch, old_logprobs_BL=trainer.token_logprobs(batch.tokens_BL, temperature=1.0) * batch.loss_mask_BL
    )
    one = make_trainer(optimizer=OptimizerConfig(lr=3e-2)).train_step(batch, temperature=1.0, grpo=GRPO)
    # One step from pi_old: the ratio is 1 (bf16 recompute noise aside) and nothing is clipped.
    assert one["clip_fraction"] == 0.0 and one["ratio_max"] < 1.01 and one["optimizer_steps"] == 1
    grpo = dataclasses.replace(GRPO, epochs=3, mini_batches=2, clip_eps_low=0.05, clip_eps_high=0.05)
    many = trainer.train_step(batch, temperature=1.0, grpo=grpo)
    assert many["optimizer_steps"] == 6 and trainer.step == 1  # one GRPO step, one weight version
    assert many["ratio_max"] > 1.05 and many["approx_kl"] > 0
    assert many["clip_frac_low"] > 0 and many["clip_frac_high"] > 0
    assert many["clip_fraction"] == pytest.approx(many["clip_frac_low"] + many["clip_frac_high"])
    assert many["lr"] == one["lr"]  # the schedule steps once per batch


def test_entropy_metric_matches_the_whole_logits_path_and_the_bonus_raises_it(make_trainer):
    batch = make_batch(seed=12)
    chunked = make_trainer(logprob_chunk_tokens=5).train_step(batch, temperature=0.7, grpo=GRPO)
    whole = make_trainer(logprob_chunk_tokens=0).train_step(batch, temperature=0.7, grpo=GRPO)
    assert 0 < chunked["entropy"] < torch.log(torch.tensor(16.0)).item()
    assert chunked["entropy"] == pytest.approx(whole["entropy"], rel=1e-3)  # bf16 logits, other GEMM shapes
    # The bonus alone (advantages 0) moves the policy toward higher entropy.
    flat = dataclasses.replace(batch, advantages_B=torch.zeros(8))
    bonus = dataclasses.replace(GRPO, entropy_coef=1.0)
    for chunk in (5, 0):
        trainer = make_trainer(logprob_chunk_tokens=chunk, optimizer=OptimizerConfig(lr=3e-2))
        before = trainer.train_step(flat, temperature=0.7, grpo=bonus)["entropy"]
        after = trainer.train_step(flat, temperature=0.7, grpo=bonus)["entropy"]
        assert after > before + 1e-3, (chunk, before, after)


def test_epochs_and_mini_batches_with_lora_step_only_the_adapters(make_trainer):
    trainer = make_trainer(model_config=ModelConfig(lora=LoRAConfig(rank=2)), optimizer=OptimizerConfig(lr=3e-2))
    before = {k: p.full_tensor().clone() for k, p in trainer.model.named_parameters()}
    metrics = trainer.train_step(make_batch(seed=13), temperature=1.0,
                                 grpo=dataclasses.replace(GRPO, epochs=2, mini_batches=2))
    assert metrics["optimizer_steps"] == 4 and metrics["ratio_max"] > 1.0
    moved = {k for k, p in trainer.model.named_parameters() if not torch.equal(p.full_tensor(), before[k])}
    assert moved and all("lora" in k for k in moved), sorted(moved)[:3]


def test_dr_grpo_counts_rows_whose_tokens_are_all_masked(make_trainer):
    # Overlong filtering masks rows 4-7 whole. Dr. GRPO's normaliser is rows x max_tokens, so the step equals
    # the one where those rows stay in with advantage 0 (no gradient, same normaliser); dividing by the 4 rows
    # with a scored token instead (the old count) would double every gradient.
    grpo = dataclasses.replace(GRPO, loss_aggregation="seq_mean_token_sum_norm")
    batch = make_batch(seed=6)
    cut_B = torch.arange(8) >= 4
    masked = dataclasses.replace(batch, loss_mask_BL=batch.loss_mask_BL * ~cut_B[:, None])
    zeroed = dataclasses.replace(batch, advantages_B=torch.where(cut_B, 0.0, batch.advantages_B))
    a = make_trainer(max_grad_norm=0.0, model_config=FP32)
    b = make_trainer(max_grad_norm=0.0, model_config=FP32)
    m_a = a.train_step(masked, temperature=1.0, grpo=grpo, max_tokens=7)
    m_b = b.train_step(zeroed, temperature=1.0, grpo=grpo, max_tokens=7)
    assert m_a["grad_norm"] == pytest.approx(m_b["grad_norm"], rel=GRAD_RTOL) and m_a["grad_norm"] > 0
    for name, g in _grads(b).items():
        torch.testing.assert_close(_grads(a)[name], g, rtol=0, atol=GRAD_RTOL * g.abs().max().item())


def test_bfloat16_masters_keep_weights_gradients_and_adamw_state_in_bfloat16(make_trainer):
    """trainer.master_dtype bfloat16: half the trainer's bytes; the RoPE buffers stay float32 and a step still
    learns (the advantage test's direction)."""
    trainer = make_trainer(master_dtype="bfloat16", optimizer=OptimizerConfig(lr=1e-2))
    batch = make_batch(seed=4, batch_size=2)
    before_BL = trainer.token_logprobs(batch.tokens_BL, temperature=1.0)
    batch = dataclasses.replace(batch, old_logprobs_BL=before_BL * batch.loss_mask_BL,
                                advantages_B=torch.tensor([1.0, 0.0]))
    trainer.train_step(batch, temperature=1.0, grpo=GRPO)
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    assert {g.dtype for g in _grads(trainer).values()} == {torch.bfloat16}
    assert {s.dtype for st in trainer.optimizer.state.values() for k, s in st.items() if k != "step"} == {torch.bfloat16}
    assert {b.dtype for b in trainer.model.buffers()} == {torch.float32}
    after_BL = trainer.token_logprobs(batch.tokens_BL, temperature=1.0)
    assert ((after_BL - before_BL) * batch.loss_mask_BL)[0].sum().item() > 0.05
