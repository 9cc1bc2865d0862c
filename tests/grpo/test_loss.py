import pytest
import torch

from torchtitan_rl.grpo import grpo_loss

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
