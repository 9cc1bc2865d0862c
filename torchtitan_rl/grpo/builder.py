"""A step's rollouts -> this rank's TrainBatch: score, advantages, pack, recompute pi_old, weights.

The loop's steps 3-5 (score, advantages, recompute); every rank calls
``build`` in the same order, since scoring and the statistics are collective.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from torchtitan_rl.config import JobConfig
from torchtitan_rl.grpo.advantages import group_advantages
from torchtitan_rl.grpo.batch import TrainBatch, logprob_mismatch, pack_rollouts, pack_routes, routing_mismatch
from torchtitan_rl.grpo.groups import Groups, fill_with_signal, rollout_metrics, score_groups
from torchtitan_rl.grpo.loss import importance_weights
from torchtitan_rl.grpo.tasks.base import Prompt, Task


class Scorer(Protocol):
    """What the builder needs of a model (trainer/trainer.py's Trainer): its data-parallel share and its logprobs.

    A protocol rather than the Trainer itself, so that grpo/ stays below trainer/ (tests/test_imports.py)."""

    dp_rank: int
    dp_size: int

    def token_logprobs(
        self, tokens_BL: torch.Tensor, *, temperature: float, mask_BL: torch.Tensor | None = None,
        replay_BLNK: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def token_logprobs_and_routes(
        self, tokens_BL: torch.Tensor, *, temperature: float, mask_BL: torch.Tensor | None = None,
        replay_BLNK: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass
class StepBatch:
    """What the trainer trains on this step, and what the log reports of it."""

    drawn: Groups
    """The step's first draw, scored (before dynamic sampling): its rewards are the ones logged."""
    train: TrainBatch
    """This rank's rows."""
    rollout_stats: dict[str, float]
    """grpo.groups.rollout_metrics of the first draw."""
    sampling_stats: dict[str, float]
    """Dynamic sampling's counts ({} when off)."""
    mismatch: dict[str, float]
    """|trainer - generator| logprob over all ranks' tokens (NaN under truncated sampling)."""
    importance: dict[str, float]
    """Statistics of the off-policy ratio pi_old / mu over all ranks' tokens."""
    routing: dict[str, float]
    """MoE: how often the recompute routed tokens elsewhere than the generator (grpo/batch.py's
    routing_mismatch, over all ranks' tokens); {} for a dense model or without the generator's choices."""


class BatchBuilder:
    """Built once per run; ``build`` turns each step's rollouts into its StepBatch."""

    def __init__(self, cfg: JobConfig, *, task: Task, trainer: Scorer, reference: Scorer | None,
                 device: torch.device) -> None:
        self.cfg, self.task, self.trainer, self.reference, self.device = cfg, task, trainer, reference, device
        grpo = cfg.grpo
        self.score = functools.partial(  # (prompts, rollouts) -> Groups: rewards, overlong penalty, cut flags
            score_groups, task, group_size=grpo.group_size, max_tokens=cfg.generator.sampling.max_tokens,
            overlong=grpo.overlong, overlong_buffer=grpo.overlong_buffer,
            overlong_penalty_at_max=grpo.overlong_penalty, device=device,
        )

    def build(self, prompts: list[Prompt], rollouts, *,
              refill: Callable[[int, int], tuple[list[Prompt], object]]) -> StepBatch:
        """``refill(round, n)``: (prompts, rollouts) of dynamic sampling's extra draw ``round``, n prompts."""
        cfg, trainer = self.cfg, self.trainer
        P, G = cfg.grpo.prompts_per_step, cfg.grpo.group_size
        temperature = cfg.generator.sampling.temperature
        # 3. score: each rank a share, gathered (every rank trains on the same rewards); DAPO's
        #    dynamic sampling replaces groups without signal by fresh ones, sampled now
        drawn = self.score(prompts, rollouts)
        rollout_stats = rollout_metrics(drawn)  # the step's first sample, before any filtering
        batch, sampling_stats = drawn, {}
        if cfg.grpo.dynamic_sampling:
            batch, sampling_stats = fill_with_signal(
                drawn, lambda round_, n: self.score(*refill(round_, n)), want=P,
                max_rounds=cfg.grpo.dynamic_sampling_max_rounds,
            )
        # 4. group-relative advantages
        advantages_B = group_advantages(batch.rewards_B, group_size=G, norm=cfg.grpo.advantage_norm)

        # 5. this rank's rows; the trainer recomputes their logprobs
        tokens_BL, mask_BL, gen_lp_BL = pack_rollouts(
            batch.prompt_ids, batch.completion_ids, batch.logprobs, pad_id=self.task.pad_id,
            loss_mask=batch.loss_mask,
        )
        if cfg.grpo.overlong == "mask":  # DAPO's overlong filtering: cut completions leave the loss
            if batch.truncated_B.all():  # nothing would be left to score: the same zero policy gradient
                advantages_B = torch.zeros_like(advantages_B)
            else:
                mask_BL[batch.truncated_B] = 0
        # Tensor-parallel peers share a data shard: split over data-parallel ranks only.
        per_rank = P * G // trainer.dp_size
        rows = slice(trainer.dp_rank * per_rank, (trainer.dp_rank + 1) * per_rank)
        tokens_BL, mask_BL, gen_lp_BL = tokens_BL[rows], mask_BL[rows], gen_lp_BL[rows]
        gen_routes_BLNK = None if batch.routes is None else pack_routes(batch.routes, tokens_BL.shape[1])[rows]
        replay_BLNK = gen_routes_BLNK if cfg.grpo.routing_replay else None
        trainer_lp_BL, routes_BLNK = trainer.token_logprobs_and_routes(
            tokens_BL, temperature=temperature, mask_BL=mask_BL, replay_BLNK=replay_BLNK)
        trainer_lp_BL = trainer_lp_BL.cpu()
        routing = {}
        if routes_BLNK is not None and gen_routes_BLNK is not None:  # the trainer's own choices vs the generator's
            routing = routing_mismatch(routes_BLNK, gen_routes_BLNK)
            routing = self._reduce_counts(routing, count="routing_tokens")
        mismatch = self._reduce(logprob_mismatch(trainer_lp_BL, gen_lp_BL, mask_BL), mask_BL)
        sampling = cfg.generator.sampling
        if sampling.top_p < 1 or sampling.top_k != -1:  # the generator's logprobs are the truncated distribution's
            mismatch = dict.fromkeys(mismatch, float("nan"))
        # off-policy weight pi_old / mu of each token, capped (None: grpo.importance_correction off)
        is_weights_BL, is_stats = importance_weights(
            trainer_lp_BL, gen_lp_BL, mask_BL, mode=cfg.grpo.importance_correction, cap=cfg.grpo.importance_cap,
            level=cfg.grpo.ratio_level,  # GSPO corrects whole sequences, as it clips them
        )
        is_stats = self._reduce(is_stats, mask_BL)
        ref_lp_BL = None
        if self.reference is not None:  # the frozen initial policy of the KL term
            ref_lp_BL = self.reference.token_logprobs(tokens_BL, temperature=temperature, mask_BL=mask_BL).cpu()
        return StepBatch(
            drawn=drawn,
            train=TrainBatch(tokens_BL, mask_BL, trainer_lp_BL, advantages_B[rows], ref_lp_BL, is_weights_BL,
                             replay_routes_BLNK=replay_BLNK),
            rollout_stats=rollout_stats, sampling_stats=sampling_stats, mismatch=mismatch, importance=is_stats,
            routing=routing,
        )

    def _reduce_counts(self, local: dict[str, float], *, count: str) -> dict[str, float]:
        """Fractions over this rank's ``local[count]`` items -> the same fractions over all ranks' items."""
        if dist.get_world_size() == 1:
            return local
        n = local[count]
        sums = torch.tensor([local[k] * n if k != count else n for k in local], dtype=torch.float64,
                            device=self.device)
        dist.all_reduce(sums)
        total = max(sums[list(local).index(count)].item(), 1.0)
        return {k: (s if k == count else s / total) for k, s in zip(local, sums.tolist())}

    def _reduce(self, local: dict[str, float], mask_BL: torch.Tensor) -> dict[str, float]:
        """Per-token statistics of this rank's rows over all ranks' tokens: keys ending in _max by max,
        the others (means, fractions) weighted by each rank's token count."""
        if dist.get_world_size() == 1:
            return local
        n = mask_BL.sum().item()
        means = [k for k in local if not k.endswith("_max")]
        peaks = [k for k in local if k.endswith("_max")]
        sums = torch.tensor([local[k] * n for k in means] + [n], dtype=torch.float64, device=self.device)
        peak = torch.tensor([local[k] for k in peaks], dtype=torch.float64, device=self.device)
        dist.all_reduce(sums)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        total = max(sums[-1].item(), 1.0)
        reduced = {**{k: s / total for k, s in zip(means, sums.tolist())}, **dict(zip(peaks, peak.tolist()))}
        return {k: reduced[k] for k in local}  # the caller's key order
