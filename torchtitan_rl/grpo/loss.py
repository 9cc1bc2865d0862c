"""The GRPO policy loss: a PPO-style clipped surrogate per token (or per sequence, GSPO), and its off-policy weight.

Every token of a completion shares its completion's advantage. The ratio
pi / pi_old lets several optimizer steps reuse one batch of rollouts
(grpo.epochs x grpo.mini_batches); clipping it keeps each update inside a
trust region around pi_old, the trainer's own recompute at the start of the
batch. The tokens were sampled by
the generator, mu, which differs from pi_old by its kernels (bf16 rounding)
and, with grpo.max_staleness > 0, by older weights: ``importance_weights``
gives each token the weight pi_old / mu, truncated or masked at a cap
(docs/design.md, "Asynchronous GRPO"). How the per-token terms become one
number (token or sequence means, Dr. GRPO's constant) and GSPO's sequence
ratio: docs/design.md, "The research surface".
"""

from typing import Literal

import torch
from torch import Tensor


LossAggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]
"""How per-token losses become one number (docs/design.md, "Loss aggregation")."""


def grpo_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    ref_logprobs_BT: Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: int | None = None,
    is_weights_BT: Tensor | None = None,
    aggregation: LossAggregation = "token_mean",
    num_sequences: int | None = None,
    max_tokens: int | None = None,
    ratio_level: Literal["token", "sequence"] = "token",
    entropy_BT: Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped surrogate (+ optional k3 KL to a reference, - optional entropy bonus), aggregated over tokens.

    Args:
        logprobs_BT: log pi(token) under the policy being trained; carries grad.
        old_logprobs_BT: log pi_old(token), the policy at the start of the batch (the trainer's recompute).
        advantages_B: one advantage per sequence, broadcast over its tokens.
        mask_BT: 1/True on completion tokens to score; prompt and padding are 0.
        clip_eps_low, clip_eps_high: ratio is clipped to [1 - low, 1 + high].
        ref_logprobs_BT: log pi_ref(token) of a frozen reference, for the KL term.
        kl_coef: weight of the k3 KL estimate exp(ref - lp) - (ref - lp) - 1.
        num_tokens: token_mean's normaliser. Pass the valid-token count of
            the whole batch when this call sees one micro-batch: the summed
            micro-batch losses (and gradients) then equal the full-batch loss.
            None uses this call's own valid-token count.
        is_weights_BT: per-token importance weight pi_old / mu (capped), from
            ``importance_weights``; it multiplies the clipped surrogate (not the
            KL term). None: no correction, the loss as without it, bit for bit.
        aggregation: token_mean (DAPO): sum over every valid token / token count;
            seq_mean_token_mean (GRPO, Shao et al. 2024): each sequence's token mean,
            averaged over sequences; seq_mean_token_sum_norm (Dr. GRPO, Liu et al.
            2025): sum over tokens / (rows x max_tokens), a constant per batch shape:
            rows whose tokens are all masked (overlong filtering) still count.
        num_sequences: the seq_* aggregations' sequence count of the whole batch:
            seq_mean_token_mean's sequences with at least one scored token,
            seq_mean_token_sum_norm's rows (every sequence); None: this call's.
        max_tokens: seq_mean_token_sum_norm's constant (generator.sampling.max_tokens).
        ratio_level: token: pi / pi_old per token (PPO, GRPO); sequence (GSPO, Zheng
            et al. 2025): every token of a sequence takes the sequence's geometric-mean
            ratio exp(mean_t log(pi / pi_old)), clipped as one.
        entropy_BT: the policy's entropy at each position (differentiable for a bonus).
        entropy_coef: the bonus: the aggregated entropy times this is subtracted.

    Every row is whole in one call (micro-batches split rows, never columns), so
    per-sequence means and the GSPO ratio are exact in each call.

    Returns the scalar loss and float metrics: loss; clip_fraction, clip_frac_low,
    clip_frac_high (share of valid tokens whose gradient the low / high clip removed);
    kl (mean k3 to the reference; 0 without one); approx_kl, the k3 estimate of
    KL(pi_old || pi) = mean (r - 1) - log r over token ratios r; ratio_mean and
    ratio_max of the ratio the loss used; entropy (mean; 0 without entropy_BT);
    and tokens (this call's valid-token count, to weight the means when combining
    micro-batches).
    """
    assert logprobs_BT.shape == old_logprobs_BT.shape == mask_BT.shape, (
        f"shape mismatch: {logprobs_BT.shape}, {old_logprobs_BT.shape}, {mask_BT.shape}"
    )
    assert advantages_B.shape == logprobs_BT.shape[:1], (
        f"advantages {tuple(advantages_B.shape)} vs logprobs {tuple(logprobs_BT.shape)}"
    )
    assert kl_coef == 0.0 or ref_logprobs_BT is not None, "kl_coef > 0 needs ref_logprobs_BT"
    assert entropy_coef == 0.0 or entropy_BT is not None, "entropy_coef > 0 needs entropy_BT"
    assert num_tokens is None or num_tokens > 0, f"num_tokens must be positive, got {num_tokens}"
    assert num_sequences is None or num_sequences > 0, f"num_sequences must be positive, got {num_sequences}"
    assert aggregation != "seq_mean_token_sum_norm" or (max_tokens or 0) > 0, "seq_mean_token_sum_norm needs max_tokens"
    if clip_eps_low < 0 or clip_eps_high < 0:
        raise ValueError(
            f"grpo.clip_eps_low/high must be >= 0, got {clip_eps_low}, {clip_eps_high}"
        )

    mask_BT = mask_BT.bool()
    # At least fp32: bf16 logprobs lose the small ratio differences clipping acts on.
    dtype = torch.promote_types(logprobs_BT.dtype, torch.float32)
    logprobs_BT = logprobs_BT.to(dtype)
    # Zero the log-ratio on masked positions *before* exp: padding may hold
    # garbage logprobs, and exp(inf) there would turn into NaN gradients.
    log_ratio_BT = torch.where(mask_BT, logprobs_BT - old_logprobs_BT.to(dtype), 0.0)
    seq_tokens_B1 = mask_BT.sum(dim=1, keepdim=True)
    if ratio_level == "sequence":
        # GSPO: log s_i = mean over the sequence's tokens of log(pi / pi_old); 0 for an empty row.
        log_seq_ratio_B1 = log_ratio_BT.sum(dim=1, keepdim=True) / seq_tokens_B1.clamp(min=1)
        ratio_BT = torch.exp(log_seq_ratio_B1).expand_as(log_ratio_BT)
    else:
        assert ratio_level == "token", ratio_level
        ratio_BT = torch.exp(log_ratio_BT)
    adv_B1 = advantages_B.to(dtype).unsqueeze(1)
    unclipped_BT = ratio_BT * adv_B1
    clipped_BT = ratio_BT.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high) * adv_B1
    # Pessimistic bound: where the clipped term is the smaller one its gradient
    # is 0, so the update cannot push the ratio further out of the trust region.
    per_token_BT = -torch.minimum(unclipped_BT, clipped_BT)
    if is_weights_BT is not None:
        # The tokens came from mu, not pi_old: E_mu[w * f] = E_pi_old[f] (w >= 0 keeps the min's
        # pessimism). Weights are data, no gradient flows through them.
        per_token_BT = per_token_BT * is_weights_BT.to(dtype)

    kl_BT = None
    if ref_logprobs_BT is not None:
        ref_delta_BT = torch.where(mask_BT, ref_logprobs_BT.to(dtype) - logprobs_BT, 0.0)
        # k3 (Schulman): unbiased for KL(pi || ref), always >= 0, low variance.
        kl_BT = torch.exp(ref_delta_BT) - ref_delta_BT - 1.0
        per_token_BT = per_token_BT + kl_coef * kl_BT
    if entropy_coef:
        per_token_BT = per_token_BT - entropy_coef * entropy_BT.to(dtype)

    valid = int(mask_BT.sum().item())
    seqs = int((seq_tokens_B1 > 0).sum().item())
    rows = mask_BT.shape[0]
    if aggregation == "token_mean":
        denom = num_tokens if num_tokens is not None else max(valid, 1)
        loss = torch.where(mask_BT, per_token_BT, 0.0).sum() / denom
    else:
        if aggregation == "seq_mean_token_mean":
            denom = num_sequences if num_sequences is not None else max(seqs, 1)
            per_token_BT = per_token_BT / seq_tokens_B1.clamp(min=1).to(dtype)
        else:
            # Dr. GRPO's constant: batch size x max length, the same whatever the mask leaves.
            assert aggregation == "seq_mean_token_sum_norm", aggregation
            denom = (num_sequences if num_sequences is not None else max(rows, 1)) * max_tokens
        loss = torch.where(mask_BT, per_token_BT, 0.0).sum() / denom

    with torch.no_grad():
        clipped_high_BT = (adv_B1 > 0) & (ratio_BT > 1.0 + clip_eps_high)
        clipped_low_BT = (adv_B1 < 0) & (ratio_BT < 1.0 - clip_eps_low)
        token_ratio_BT = torch.exp(log_ratio_BT)

        def masked_mean(x_BT: Tensor) -> float:
            return (torch.where(mask_BT, x_BT.float(), 0.0).sum() / max(valid, 1)).item()

        metrics = {
            "loss": loss.item(),
            "clip_fraction": masked_mean(clipped_high_BT | clipped_low_BT),
            "clip_frac_low": masked_mean(clipped_low_BT),
            "clip_frac_high": masked_mean(clipped_high_BT),
            "kl": masked_mean(kl_BT) if kl_BT is not None else 0.0,
            "approx_kl": masked_mean(token_ratio_BT - 1.0 - log_ratio_BT),
            "ratio_mean": masked_mean(ratio_BT),
            "ratio_max": ratio_BT[mask_BT].max().item() if valid else 0.0,
            "entropy": masked_mean(entropy_BT) if entropy_BT is not None else 0.0,
            "tokens": float(valid),
            "sequences": float(seqs),
        }
    return loss, metrics


_MAX_LOG_RATIO = 20.0
"""|log(pi_old / mu)| is clamped here before exp (weights within [2e-9, 5e8]): a token the generator
sampled at a logprob the trainer calls -inf must not make the metrics inf or the weight NaN."""


RATIO_KEYS = ("is_weight_mean", "is_weight_max", "is_capped_frac")
"""importance_weights's statistics of pi_old / mu (train_step reports the same under grpo.old_logprobs train)."""


@torch.no_grad()
def importance_weights(
    old_logprobs_BT: Tensor,
    generator_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    mode: Literal["off", "truncate", "mask"],
    cap: float,
    level: Literal["token", "sequence"] = "token",
    ages_BT: Tensor | None = None,
    max_age: int = 0,
) -> tuple[Tensor | None, dict[str, float]]:
    """Per-token weight w of the off-policy correction from rho = pi_old / mu, and its statistics.

    Args:
        old_logprobs_BT: log pi_old, the trainer's recompute with the weights it trains from.
        generator_logprobs_BT: log mu, the generator's logprob of the token it sampled.
        mask_BT: 1/True on scored completion tokens.
        mode: truncate (TIS, Yao et al. 2025): w = min(rho, cap); mask: w = rho where
            1/cap <= rho <= cap, else 0 (the token leaves the gradient, not the normaliser);
            off: no weights (None), statistics only.
        cap: C > 1.
        level: token: rho of each token; sequence (GSPO's): every token of a sequence takes the
            sequence's geometric mean exp(mean_t log(pi_old / mu)), capped or masked as one.
        ages_BT: how many weight versions each token's sampler is behind pi_old (partial rollouts: the
            tokens of one sequence may differ; mu is each token's own sampler, so rho is per token whatever
            the mix); None: not reported.
        max_age: the largest age allowed (grpo.partial.max_token_age); ages_BT must stay within it.

    Returns the weights (float32, 0 off the mask; None when off) and metrics
    over the scored tokens: ``is_weight_mean`` and ``is_weight_max`` of rho
    before the cap, and ``is_capped_frac``, the share of tokens the cap changed
    (0 when off); with ``ages_BT``, ``version_age_{k}_frac`` for k in 0..max_age (the share of
    tokens sampled k versions back) and ``version_age_max``.
    """
    mask_BT = mask_BT.bool()
    log_rho_BT = torch.where(mask_BT, old_logprobs_BT.float() - generator_logprobs_BT.float(), 0.0)
    if level == "sequence":
        log_rho_BT = (log_rho_BT.sum(dim=1, keepdim=True) / mask_BT.sum(dim=1, keepdim=True).clamp(min=1)
                      ).expand_as(log_rho_BT)
    else:
        assert level == "token", level
    log_rho_BT = log_rho_BT.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    rho_BT = torch.where(mask_BT, torch.exp(log_rho_BT), 0.0)
    if mode == "truncate":
        capped_BT = mask_BT & (rho_BT > cap)
        weights_BT = rho_BT.clamp(max=cap)
    elif mode == "mask":
        capped_BT = mask_BT & ((rho_BT > cap) | (rho_BT < 1.0 / cap))
        weights_BT = torch.where(capped_BT, 0.0, rho_BT)
    else:
        assert mode == "off", mode
        capped_BT, weights_BT = torch.zeros_like(mask_BT), None
    valid = int(mask_BT.sum().item())
    n = max(valid, 1)
    stats = {
        "is_weight_mean": rho_BT.sum().item() / n,
        "is_weight_max": rho_BT[mask_BT].max().item() if valid else 0.0,
        "is_capped_frac": capped_BT.sum().item() / n,
    }
    if ages_BT is not None:
        stats |= version_age_stats(ages_BT, mask_BT, max_age=max_age)
    return weights_BT, stats


def version_age_stats(ages_BT: Tensor, mask_BT: Tensor, *, max_age: int) -> dict[str, float]:
    """``version_age_{k}_frac`` for k in 0..max_age, the share of scored tokens sampled k weight versions back,
    and ``version_age_max``; asserts none is older than ``max_age`` (grpo.partial.max_token_age)."""
    mask_BT = mask_BT.bool()
    ages = ages_BT[mask_BT]
    n = max(ages.numel(), 1)
    assert ages.numel() == 0 or 0 <= ages.min().item() and ages.max().item() <= max_age, (
        "a token older than grpo.partial.max_token_age reached the loss", ages.min().item(), ages.max().item())
    stats = {}
    for k in range(max_age + 1):  # every age up to the bound: the keys are the same on every rank and step
        stats[f"version_age_{k}_frac"] = (ages == k).sum().item() / n
    stats["version_age_max"] = float(ages.max().item()) if ages.numel() else 0.0
    return stats
