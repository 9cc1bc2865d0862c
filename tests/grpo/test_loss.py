import pytest
import torch

from torchtitan_rl.grpo import grpo_loss
from torchtitan_rl.grpo.loss import importance_weights

CLIP = dict(clip_eps_low=0.2, clip_eps_high=0.2)


def _ragged_batch(seed: int = 0, B: int = 6, T: int = 7, dtype=torch.float32):
    """Random logprobs near the old ones, ragged masks, mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    old_BT = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    logprobs_BT = old_BT + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)
    advantages_B = torch.randn(B, generator=g, dtype=dtype)
    lengths_B = torch.randint(1, T + 1, (B,), generator=g)
    mask_BT = torch.arange(T)[None, :] < lengths_B[:, None]
    return logprobs_BT, old_BT, advantages_B, mask_BT


def test_on_policy_loss_and_gradient_match_hand_computed_case():
    # ratio == 1 everywhere: loss = -sum_t A_b / N and dloss/dlp_t = -A_b / N.
    old_BT = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
    logprobs_BT = old_BT.clone().requires_grad_()
    advantages_B = torch.tensor([2.0, -1.0])
    mask_BT = torch.tensor([[1, 1, 1], [1, 1, 0]])
    loss, metrics = grpo_loss(logprobs_BT, old_BT, advantages_B, mask_BT, **CLIP)
    loss.backward()
    assert loss.item() == pytest.approx(-(3 * 2.0 + 2 * -1.0) / 5)
    expected_grad_BT = torch.tensor([[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]])
    assert torch.allclose(logprobs_BT.grad, expected_grad_BT)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["kl"] == 0.0
    assert metrics["tokens"] == 5.0


def test_loss_gradient_matches_finite_difference():
    logprobs_BT, old_BT, advantages_B, mask_BT = _ragged_batch(dtype=torch.float64)
    ref_BT = old_BT + 0.1
    logprobs_BT.requires_grad_()

    def f(lp_BT):
        loss, _ = grpo_loss(
            lp_BT, old_BT, advantages_B, mask_BT, **CLIP, ref_logprobs_BT=ref_BT, kl_coef=0.3
        )
        return loss

    # Random points are almost surely away from the clip boundaries (the kinks).
    assert torch.autograd.gradcheck(f, (logprobs_BT,))


def test_clipping_stops_gradient_outside_trust_region():
    low, high = 0.2, 0.3
    # Columns: ratio 1.5 (above 1 + high), 0.5 (below 1 - low), 1.1 (inside).
    ratios = torch.tensor([1.5, 0.5, 1.1])
    old_BT = torch.full((2, 3), -1.0)
    logprobs_BT = (old_BT + ratios.log()).requires_grad_()
    advantages_B = torch.tensor([1.0, -1.0])
    mask_BT = torch.ones(2, 3, dtype=torch.bool)
    loss, metrics = grpo_loss(
        logprobs_BT, old_BT, advantages_B, mask_BT, clip_eps_low=low, clip_eps_high=high
    )
    loss.backward()
    grad_BT = logprobs_BT.grad
    # A > 0: pushing the ratio above 1 + high earns nothing -> no gradient there;
    # below 1 - low the (pessimistic) unclipped term still pulls it back up.
    assert grad_BT[0, 0] == 0.0
    assert grad_BT[0, 1] < 0.0 and grad_BT[0, 2] < 0.0
    # A < 0: mirror image: no gradient below 1 - low, gradient above 1 + high.
    assert grad_BT[1, 1] == 0.0
    assert grad_BT[1, 0] > 0.0 and grad_BT[1, 2] > 0.0
    assert metrics["clip_fraction"] == pytest.approx(2 / 6)


def test_asymmetric_clip_uses_the_high_bound_for_positive_advantages():
    old_BT = torch.zeros(1, 1)
    logprobs_BT = torch.tensor([[torch.log(torch.tensor(1.25))]], requires_grad=True)
    kwargs = dict(advantages_B=torch.ones(1), mask_BT=torch.ones(1, 1))
    loss, _ = grpo_loss(logprobs_BT, old_BT, clip_eps_low=0.2, clip_eps_high=0.28, **kwargs)
    loss.backward()
    assert logprobs_BT.grad.item() != 0.0  # 1.25 is inside [0.8, 1.28]
    loss, _ = grpo_loss(logprobs_BT, old_BT, clip_eps_low=0.2, clip_eps_high=0.2, **kwargs)
    assert loss.item() == pytest.approx(-1.2)  # clipped to 1 + 0.2


def test_microbatch_accumulation_equals_full_batch():
    logprobs_BT, old_BT, advantages_B, mask_BT = _ragged_batch(seed=1, B=6)
    ref_BT = old_BT - 0.2
    kwargs = dict(**CLIP, kl_coef=0.1)

    full_lp_BT = logprobs_BT.clone().requires_grad_()
    full_loss, _ = grpo_loss(full_lp_BT, old_BT, advantages_B, mask_BT, ref_logprobs_BT=ref_BT, **kwargs)
    full_loss.backward()

    micro_lp_BT = logprobs_BT.clone().requires_grad_()
    num_tokens = int(mask_BT.sum())
    summed_loss = 0.0
    for rows in (slice(0, 1), slice(1, 4), slice(4, 6)):  # uneven micro-batches
        loss, metrics = grpo_loss(
            micro_lp_BT[rows], old_BT[rows], advantages_B[rows], mask_BT[rows],
            ref_logprobs_BT=ref_BT[rows], num_tokens=num_tokens, **kwargs,
        )
        loss.backward()
        summed_loss += metrics["loss"]

    # fp32 throughout: the same terms summed in another order (~1e-7 relative); gradients are per token, exact up to the 1/N scale.
    assert summed_loss == pytest.approx(full_loss.item(), rel=1e-5)
    assert torch.allclose(micro_lp_BT.grad, full_lp_BT.grad, atol=1e-7)


def test_padding_with_garbage_logprobs_leaves_loss_and_gradients_finite():
    logprobs_BT, old_BT, advantages_B, mask_BT = _ragged_batch(seed=2)
    clean_lp_BT = logprobs_BT.clone().requires_grad_()
    clean_loss, _ = grpo_loss(clean_lp_BT, old_BT, advantages_B, mask_BT, **CLIP)
    clean_loss.backward()

    dirty_lp_BT = logprobs_BT.masked_fill(~mask_BT, 1e4).requires_grad_()
    dirty_old_BT = old_BT.masked_fill(~mask_BT, float("-inf"))
    dirty_loss, _ = grpo_loss(
        dirty_lp_BT, dirty_old_BT, advantages_B, mask_BT, **CLIP, ref_logprobs_BT=dirty_old_BT
    )
    dirty_loss.backward()
    assert torch.isfinite(dirty_loss)
    assert torch.equal(dirty_lp_BT.grad[~mask_BT], torch.zeros(int((~mask_BT).sum())))
    assert torch.allclose(dirty_lp_BT.grad[mask_BT], clean_lp_BT.grad[mask_BT])


def test_kl_is_zero_at_reference_and_pulls_policy_back_toward_it():
    old_BT = torch.full((1, 4), -1.0)
    mask_BT = torch.ones(1, 4)
    zero_adv_B = torch.zeros(1)
    _, metrics = grpo_loss(old_BT, old_BT, zero_adv_B, mask_BT, **CLIP, ref_logprobs_BT=old_BT)
    assert metrics["kl"] == 0.0

    logprobs_BT = (old_BT + 0.5).requires_grad_()  # policy drifted above the reference
    loss, metrics = grpo_loss(
        logprobs_BT, old_BT, zero_adv_B, mask_BT, **CLIP, ref_logprobs_BT=old_BT, kl_coef=1.0
    )
    loss.backward()
    assert metrics["kl"] > 0.0
    assert (logprobs_BT.grad > 0).all()  # descent lowers logprobs back toward ref


def test_k3_estimates_the_true_kl_when_tokens_come_from_the_policy():
    g = torch.Generator().manual_seed(0)
    policy_V = torch.log_softmax(torch.randn(16, generator=g), dim=0)
    ref_V = torch.log_softmax(torch.randn(16, generator=g), dim=0)
    tokens_N = torch.multinomial(policy_V.exp(), 200_000, replacement=True, generator=g)
    lp_1N, ref_1N = policy_V[tokens_N][None], ref_V[tokens_N][None]
    _, metrics = grpo_loss(
        lp_1N, lp_1N, torch.zeros(1), torch.ones_like(lp_1N), **CLIP, ref_logprobs_BT=ref_1N
    )
    true_kl = (policy_V.exp() * (policy_V - ref_V)).sum().item()
    assert metrics["kl"] == pytest.approx(true_kl, rel=0.05)


# ------------------------------------------------- off-policy correction (grpo.importance_correction)


def _rho_case():
    """Five scored tokens with rho = pi_old / mu = 0.25, 0.8, 1, 1.5, 3, and one padding position."""
    mu_BT = torch.log(torch.tensor([[0.4, 0.5, 0.2, 0.2, 0.1, 0.3]]))
    rho = torch.tensor([[0.25, 0.8, 1.0, 1.5, 3.0, 1.0]])
    old_BT = (mu_BT + torch.log(rho)).masked_fill(torch.tensor([[0, 0, 0, 0, 0, 1]], dtype=torch.bool), -1e9)
    mask_BT = torch.tensor([[1, 1, 1, 1, 1, 0]])
    return old_BT, mu_BT, mask_BT


def test_importance_weights_truncate_or_mask_at_the_cap():
    old_BT, mu_BT, mask_BT = _rho_case()
    expected = {
        "truncate": ([0.25, 0.8, 1.0, 1.5, 2.0, 0.0], 1 / 5),  # TIS: min(rho, 2)
        "mask": ([0.0, 0.8, 1.0, 1.5, 0.0, 0.0], 2 / 5),  # outside [1/2, 2]: weight 0
    }
    for mode, (weights, capped) in expected.items():
        weights_BT, stats = importance_weights(old_BT, mu_BT, mask_BT, mode=mode, cap=2.0)
        # rho = exp(log pi_old - log mu) in fp32: a few ulps of 1 off the exact values.
        torch.testing.assert_close(weights_BT, torch.tensor([weights]), rtol=1e-6, atol=0)
        assert stats["is_capped_frac"] == pytest.approx(capped)
        # The statistics describe rho before the cap, over scored tokens only (the padding's -1e9 is not seen).
        assert stats["is_weight_mean"] == pytest.approx((0.25 + 0.8 + 1 + 1.5 + 3) / 5, rel=1e-6)
        assert stats["is_weight_max"] == pytest.approx(3.0, rel=1e-6)
    weights_BT, stats = importance_weights(old_BT, mu_BT, mask_BT, mode="off", cap=2.0)
    assert weights_BT is None and stats["is_capped_frac"] == 0.0
    assert stats["is_weight_max"] == pytest.approx(3.0, rel=1e-6)


def test_importance_weights_report_the_share_of_tokens_by_version_age():
    old_BT, mu_BT, mask_BT = _rho_case()
    ages_BT = torch.tensor([[0, 1, 1, 0, 0, 7]])  # the padding's age is never read
    _, stats = importance_weights(old_BT, mu_BT, mask_BT, mode="truncate", cap=2.0, ages_BT=ages_BT, max_age=2)
    assert [stats[f"version_age_{k}_frac"] for k in range(3)] == [3 / 5, 2 / 5, 0.0]
    assert stats["version_age_max"] == 1.0
    with pytest.raises(AssertionError, match="older than grpo.partial.max_token_age"):
        importance_weights(old_BT, mu_BT, mask_BT, mode="truncate", cap=2.0, ages_BT=ages_BT + 1, max_age=1)


def test_weights_of_one_leave_the_loss_bitwise_unchanged_and_scale_it_per_token():
    logprobs_BT, old_BT, advantages_B, mask_BT = _ragged_batch(seed=3)
    results = {}
    cases = {"none": None, "ones": torch.ones_like(old_BT), "half": torch.full_like(old_BT, 0.5)}
    for name, weights_BT in cases.items():
        lp_BT = logprobs_BT.clone().requires_grad_()
        loss, _ = grpo_loss(lp_BT, old_BT, advantages_B, mask_BT, **CLIP, is_weights_BT=weights_BT)
        loss.backward()
        results[name] = (loss, lp_BT.grad)
    assert torch.equal(results["ones"][0], results["none"][0]) and torch.equal(results["ones"][1], results["none"][1])
    # Halving is exact in binary floating point: the sum of halves is half the sum, bit for bit.
    assert torch.equal(results["half"][0], results["none"][0] / 2)
    assert torch.equal(results["half"][1], results["none"][1] / 2)


def test_importance_weighted_gradient_from_stale_samples_is_the_on_policy_gradient():
    # One-token completions of a 16-way softmax policy: tokens come from mu (older weights), the update is
    # taken at pi_old = pi. The weighted loss's gradient must be E_pi[A grad log pi]; the unweighted
    # one estimates E_mu[A grad log pi] instead.
    g = torch.Generator().manual_seed(0)
    theta_V = torch.randn(16, generator=g)
    mu_V = torch.log_softmax(theta_V + 0.7 * torch.randn(16, generator=g), dim=0)
    reward_V = torch.randn(16, generator=g)
    tokens_N = torch.multinomial(mu_V.exp(), 200_000, replacement=True, generator=g)
    pi_V = torch.softmax(theta_V, dim=0)
    exact_V = pi_V * (reward_V - (pi_V * reward_V).sum())  # d/dtheta E_pi[reward] of a softmax

    def estimate(mode: str) -> torch.Tensor:
        theta = theta_V.clone().requires_grad_()
        lp_N1 = torch.log_softmax(theta, dim=0)[tokens_N][:, None]  # N completions of one token
        old_N1, mask_N1 = lp_N1.detach(), torch.ones_like(lp_N1)
        weights_N1, _ = importance_weights(old_N1, mu_V[tokens_N][:, None], mask_N1, mode=mode, cap=1e3)
        loss, _ = grpo_loss(lp_N1, old_N1, reward_V[tokens_N], mask_N1, **CLIP, is_weights_BT=weights_N1)
        loss.backward()
        return -theta.grad

    def error(estimate_V: torch.Tensor) -> float:
        return (torch.linalg.vector_norm(estimate_V - exact_V) / torch.linalg.vector_norm(exact_V)).item()

    # Measured: 0.0013 with the weights (200k samples; Monte Carlo error ~ 1/sqrt(N) of a weight spread
    # near 1), 0.68 without: the bounds leave a wide margin both ways.
    assert error(estimate("truncate")) < 0.02
    assert error(estimate("off")) > 0.3


# Two sequences, 3 and 1 scored tokens, on-policy (ratio 1): per-token loss -A_b.
_OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]])
_ADV = torch.tensor([2.0, -1.0])
_MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("aggregation, loss, grad_row0, grad_row1", [
    # token mean (DAPO): sum / 4 tokens.
    ("token_mean", -(3 * 2.0 - 1.0) / 4, -2.0 / 4, 1.0 / 4),
    # sequence mean of token means (GRPO): (mean(-2, -2, -2) + mean(1)) / 2.
    ("seq_mean_token_mean", (-2.0 + 1.0) / 2, -2.0 / 3 / 2, 1.0 / 2),
    # Dr. GRPO: sum / (2 sequences x max_tokens 5).
    ("seq_mean_token_sum_norm", -(3 * 2.0 - 1.0) / 10, -2.0 / 10, 1.0 / 10),
])
def test_loss_aggregations_match_hand_computed_case(aggregation, loss, grad_row0, grad_row1):
    logprobs_BT = _OLD.clone().requires_grad_()
    out, metrics = grpo_loss(logprobs_BT, _OLD, _ADV, _MASK, **CLIP, aggregation=aggregation, max_tokens=5)
    out.backward()
    assert out.item() == pytest.approx(loss)
    expected = torch.tensor([[grad_row0] * 3, [grad_row1, 0.0, 0.0]])
    torch.testing.assert_close(logprobs_BT.grad, expected)
    assert metrics["tokens"] == 4.0 and metrics["sequences"] == 2.0


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_sequence_aggregations_accumulate_over_micro_batches_exactly(aggregation):
    logprobs_BT, old_BT, advantages_B, mask_BT = _ragged_batch(seed=3, B=6)
    kwargs = dict(**CLIP, aggregation=aggregation, max_tokens=7)
    full_lp_BT = logprobs_BT.clone().requires_grad_()
    full, _ = grpo_loss(full_lp_BT, old_BT, advantages_B, mask_BT, **kwargs)
    full.backward()
    micro_lp_BT = logprobs_BT.clone().requires_grad_()
    total = 0.0
    for rows in (slice(0, 2), slice(2, 6)):
        loss, _ = grpo_loss(micro_lp_BT[rows], old_BT[rows], advantages_B[rows], mask_BT[rows],
                            num_sequences=6, **kwargs)
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(full.item(), rel=1e-5)
    torch.testing.assert_close(micro_lp_BT.grad, full_lp_BT.grad, rtol=0, atol=1e-7)


def test_gspo_ratio_is_the_geometric_mean_of_the_token_ratios_clipped_per_sequence():
    # Row 0: token ratios 2 and 0.5 -> sequence ratio 1 (inside the clip); row 1: ratios 1.5, 1.5, 1.5
    # -> 1.5 > 1 + 0.2 with a positive advantage: clipped, no gradient, every token counted as clipped.
    old_BT = torch.full((2, 3), -1.0)
    log_r = torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.5, 1.5]]).log()
    logprobs_BT = (old_BT + log_r).requires_grad_()
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 1]])
    advantages_B = torch.tensor([1.0, 1.0])
    loss, metrics = grpo_loss(logprobs_BT, old_BT, advantages_B, mask_BT, **CLIP, ratio_level="sequence",
                              aggregation="seq_mean_token_mean")
    loss.backward()
    # Sequence losses -1 * 1 and -1.2 * 1 (clipped), averaged over the two sequences.
    assert loss.item() == pytest.approx(-(1.0 + 1.2) / 2)
    # d/dlp_t of -s * A / 2 (sequence mean) with s = exp(mean_t log r): -s / n / 2 per token of row 0.
    torch.testing.assert_close(logprobs_BT.grad, torch.tensor([[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0]]))
    assert metrics["ratio_mean"] == pytest.approx((2 * 1.0 + 3 * 1.5) / 5)
    assert metrics["ratio_max"] == pytest.approx(1.5)
    assert metrics["clip_frac_high"] == pytest.approx(3 / 5) and metrics["clip_frac_low"] == 0.0


def test_clip_fractions_and_approx_kl_match_hand_computed_case():
    # Token ratios 1.5 (A > 0: high clip), 0.5 (A < 0: low clip), 0.9 (A < 0: inside), 1.1 (A > 0: inside).
    ratios = torch.tensor([[1.5, 1.1], [0.5, 0.9]])
    old_BT = torch.full((2, 2), -1.0)
    _, metrics = grpo_loss(old_BT + ratios.log(), old_BT, torch.tensor([1.0, -1.0]), torch.ones(2, 2), **CLIP)
    assert metrics["clip_frac_high"] == 0.25 and metrics["clip_frac_low"] == 0.25
    assert metrics["clip_fraction"] == 0.5
    k3 = (ratios - 1 - ratios.log()).mean().item()  # KL(pi_old || pi) estimated from pi_old's samples
    assert metrics["approx_kl"] == pytest.approx(k3)
    assert metrics["ratio_max"] == pytest.approx(1.5)


def test_entropy_bonus_subtracts_the_aggregated_entropy():
    entropy_BT = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]], requires_grad=True)
    base, _ = grpo_loss(_OLD, _OLD, _ADV, _MASK, **CLIP)
    loss, metrics = grpo_loss(_OLD, _OLD, _ADV, _MASK, **CLIP, entropy_BT=entropy_BT, entropy_coef=0.1)
    loss.backward()
    assert metrics["entropy"] == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert loss.item() == pytest.approx(base.item() - 0.1 * 10 / 4)
    torch.testing.assert_close(entropy_BT.grad, -0.1 / 4 * _MASK.float())


def test_dr_grpo_normaliser_counts_rows_whose_tokens_are_all_masked():
    # Overlong filtering masked row 1 entirely: Dr. GRPO still divides by 2 rows x max_tokens 5 (the paper's
    # constant), so masking a completion does not scale up the others' gradient.
    mask_BT = torch.tensor([[1, 1, 1], [0, 0, 0]])
    logprobs_BT = _OLD.clone().requires_grad_()
    loss, metrics = grpo_loss(logprobs_BT, _OLD, _ADV, mask_BT, **CLIP, aggregation="seq_mean_token_sum_norm",
                              max_tokens=5)
    loss.backward()
    assert loss.item() == pytest.approx(-3 * 2.0 / 10)
    torch.testing.assert_close(logprobs_BT.grad, torch.tensor([[-0.2] * 3, [0.0] * 3]))
    assert metrics["sequences"] == 1.0  # the metric still counts sequences with a scored token


def test_sequence_importance_weights_are_the_geometric_mean_per_sequence_capped_as_one():
    # Row 0: token rho 2 and 0.5 -> sequence rho 1; row 1: 3 and 3 -> 3 (over the cap 2); a padding position.
    mu_BT = torch.full((2, 3), -2.0)
    rho_BT = torch.tensor([[2.0, 0.5, 1.0], [3.0, 3.0, 1.0]])
    mask_BT = torch.tensor([[1, 1, 0], [1, 1, 0]])
    old_BT = (mu_BT + rho_BT.log()).masked_fill(~mask_BT.bool(), -1e9)
    expected = {"truncate": [[1.0, 1.0, 0.0], [2.0, 2.0, 0.0]], "mask": [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]}
    for mode, weights in expected.items():
        weights_BT, stats = importance_weights(old_BT, mu_BT, mask_BT, mode=mode, cap=2.0, level="sequence")
        torch.testing.assert_close(weights_BT, torch.tensor(weights), rtol=1e-6, atol=1e-6)
        assert stats["is_capped_frac"] == pytest.approx(2 / 4)
        assert stats["is_weight_max"] == pytest.approx(3.0, rel=1e-6)
