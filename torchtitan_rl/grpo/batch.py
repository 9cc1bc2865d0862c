"""Rollouts -> padded training tensors (TrainBatch, the trainer's input type), and the trainer-vs-generator mismatch."""

from dataclasses import dataclass

import numpy as np
import torch


def pack_rollouts(
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    generator_logprobs: list[list[float]],
    *,
    pad_id: int,
    loss_mask: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens_BL (right-padded), loss_mask_BL, gen_logprobs_BL.

    Position t of loss_mask_BL / gen_logprobs_BL refers to token tokens_BL[:, t]
    (the trainer's logprob convention): completion tokens are scored, prompt
    and padding are not, nor completion tokens whose ``loss_mask`` is 0 (a
    tool's output inside a multi-turn episode).
    """
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)]
    L = max(lengths)
    # Each row padded as a Python list, then one array per field (numpy converts lists of numbers ~10x faster than
    # torch.tensor): a tensor and a slice per row took ~0.2 s a step at 512 rows of 356 tokens (docs/benchmarks.md,
    # "Host time of a step's batch build (cpu)").
    tokens, mask, gen = [], [], []
    for b, (p, c, lp) in enumerate(zip(prompt_ids, completion_ids, generator_logprobs)):
        assert len(c) == len(lp), "one generator logprob per completion token"
        pad = L - len(p) - len(c)
        tokens.append([*p, *c, *[pad_id] * pad])
        mask.append([*[0] * len(p), *([1] * len(c) if loss_mask is None else loss_mask[b]), *[0] * pad])
        gen.append([*[0.0] * len(p), *lp, *[0.0] * pad])
    return (torch.from_numpy(np.array(tokens, dtype=np.int64)), torch.from_numpy(np.array(mask, dtype=np.float32)),
            torch.from_numpy(np.array(gen, dtype=np.float32)))


def pack_versions(prompt_ids: list[list[int]], versions: list[list[int]], *, length: int) -> torch.Tensor:
    """versions_BL (long): the weight version each completion token of ``pack_rollouts``' tokens_BL was sampled
    with, at the same positions; -1 on prompt and padding."""
    versions_BL = torch.full((len(prompt_ids), length), -1, dtype=torch.long)
    for b, (p, v) in enumerate(zip(prompt_ids, versions)):
        versions_BL[b, len(p) : len(p) + len(v)] = torch.tensor(v, dtype=torch.long)
    return versions_BL


def rank_rows(lengths: list[int], *, rank: int, ranks: int) -> torch.Tensor:
    """long: the rows of a batch whose rows hold ``lengths`` tokens that data-parallel ``rank`` of ``ranks`` trains:
    as many rows as every other rank, and nearly as many tokens (within the longest row).

    The rows are dealt longest first, back and forth over the ranks (0, 1, .., n-1, n-1, .., 0, 0, 1, ..), so each
    rank gets a like share of the long ones whatever the batch's order: a partial-rollouts batch lists its oldest
    groups, the ones carried over because they ran long, first, and a contiguous block each gave one rank most of
    the step's tokens while the others waited for it in every collective. A rank keeps its rows in the batch's order
    (its mini-batches cut that order as before); one rank trains every row in order."""
    assert len(lengths) % ranks == 0 and 0 <= rank < ranks, (len(lengths), rank, ranks)
    if ranks == 1:
        return torch.arange(len(lengths))
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])  # stable: ties keep the batch's order
    laps = [divmod(i, ranks) for i in range(len(order))]  # (lap, seat): even laps deal 0..n-1, odd ones n-1..0
    mine = [row for row, (lap, seat) in zip(order, laps) if (seat if lap % 2 == 0 else ranks - 1 - seat) == rank]
    return torch.tensor(sorted(mine), dtype=torch.long)


MISMATCH_KEYS = ("mismatch_mean", "mismatch_max", "mismatch_frac_tokens")
"""logprob_mismatch's metrics (train_step reports the same under grpo.old_logprobs train)."""


def logprob_mismatch(trainer_BL: torch.Tensor, generator_BL: torch.Tensor, mask_BL: torch.Tensor) -> dict[str, float]:
    """Per-token |trainer - generator| logprob over scored tokens: the sync's health signal."""
    valid = mask_BL.bool().cpu()  # the trainer's mask is on its GPU (grpo.old_logprobs train), the builder's not
    diff = (trainer_BL.float().cpu() - generator_BL.float().cpu()).abs()[valid]
    if diff.numel() == 0:
        return dict.fromkeys(MISMATCH_KEYS, 0.0)
    return {
        "mismatch_mean": diff.mean().item(),
        "mismatch_max": diff.max().item(),
        "mismatch_frac_tokens": (diff != 0).float().mean().item(),
    }


def pack_routes(routes: list, length: int) -> torch.Tensor:
    """int16 [B, length, MoE layers, top-k]: each row's generator expert choices (engine/rollouts.py's
    ``routes``) at its positions, -1 past them (padding, and the last token, which no forward computed)."""
    first = next(r for r in routes)
    out = torch.full((len(routes), length, *first.shape[1:]), -1, dtype=torch.int16)
    for b, r in enumerate(routes):
        out[b, : r.shape[0]] = torch.from_numpy(r)
    return out


def routing_mismatch(trainer_BLNK: torch.Tensor, generator_BLNK: torch.Tensor) -> dict[str, float]:
    """How often the trainer's recompute routes a token elsewhere than the generator's forward did, over the
    positions both computed: routing_mismatch, the fraction of tokens whose top-k expert set differs at any
    MoE layer; routing_mismatch_layers, the fraction of (token, layer) pairs whose set differs."""
    both_BLN = (trainer_BLNK >= 0).all(-1) & (generator_BLNK >= 0).all(-1)
    differ_BLN = (trainer_BLNK.sort(dim=-1).values != generator_BLNK.sort(dim=-1).values).any(-1) & both_BLN
    tokens_BL = both_BLN.all(-1)
    n_tokens, n_pairs = tokens_BL.sum().item(), both_BLN.sum().item()
    return {
        "routing_mismatch": (differ_BLN.any(-1) & tokens_BL).sum().item() / max(n_tokens, 1),
        "routing_mismatch_layers": differ_BLN.sum().item() / max(n_pairs, 1),
        "routing_tokens": float(n_tokens),
    }


@dataclass
class TrainBatch:
    """One rank's share of a step's rollouts, right-padded to a common length L (what the trainer trains on)."""

    tokens_BL: torch.Tensor
    """Prompt + completion token ids (long), right-padded with the pad id."""
    loss_mask_BL: torch.Tensor
    """1 where tokens_BL[:, t] is a scored completion token; column 0 is always 0."""
    old_logprobs_BL: torch.Tensor | None
    """float32 log pi_old of tokens_BL[:, t] (the ratio's reference: the trainer's recompute) at scored positions, 0
    elsewhere; None: the training forward's own logprobs, detached (grpo.old_logprobs train)."""
    advantages_B: torch.Tensor
    """float32 advantage of each sequence."""
    ref_logprobs_BL: torch.Tensor | None = None
    """float32 reference-model logprobs, needed when grpo.kl_coef > 0."""
    is_weights_BL: torch.Tensor | None = None
    """float32 off-policy weight of each scored token (grpo.loss.importance_weights); None: no correction."""
    generator_logprobs_BL: torch.Tensor | None = None
    """With old_logprobs_BL None: the generator's logprobs, which train_step compares with its forward's
    (logprob_mismatch's metrics, measured where the recompute would have)."""
    replay_routes_BLNK: torch.Tensor | None = None
    """MoE under grpo.routing_replay: int16 [B, L, MoE layers, top-k] the generator's expert choices, which the
    loss's forwards route by (-1: the trainer's router decides); None: the trainer routes itself."""
