"""A step's rollouts -> this rank's TrainBatch: score, advantages, pack, recompute pi_old, weights.

The loop's steps 3-5 (score, advantages, recompute); every rank calls
``build`` in the same order, since scoring and the statistics are collective.
"""

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from torchtitan_rl.config import JobConfig
from torchtitan_rl.grpo.advantages import group_advantages
from torchtitan_rl.grpo.batch import (
    MISMATCH_KEYS, TrainBatch, logprob_mismatch, pack_rollouts, pack_routes, pack_versions, rank_rows,
    routing_mismatch,
)
from torchtitan_rl.grpo.groups import Groups, fill_with_signal, rollout_metrics, score_groups
from torchtitan_rl.grpo.loss import RATIO_KEYS, importance_weights, version_age_stats
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
    mismatch: dict[str, float] | None
    """|trainer - generator| logprob over all ranks' tokens (NaN under truncated sampling); None until
    ``measured_in_training`` fills it (grpo.old_logprobs train)."""
    importance: dict[str, float]
    """Statistics of the off-policy ratio pi_old / mu over all ranks' tokens."""
    routing: dict[str, float]
    """MoE: how often the recompute routed tokens elsewhere than the generator (grpo/batch.py's
    routing_mismatch, over all ranks' tokens); {} for a dense model or without the generator's choices."""
    recompute_s: float
    """Seconds of the trainer's (and the reference's) logprob recompute in ``build``."""
    ranks: dict[str, float]
    """train_rank_balance: the data-parallel ranks' mean tokens (prompt + completion) over the most any rank
    trains, which the others wait for in every collective (1: even); {} with one process."""


class BatchBuilder:
    """Built once per run; ``build`` turns each step's rollouts into its StepBatch."""

    def __init__(self, cfg: JobConfig, *, task: Task, trainer: Scorer, reference: Scorer | None,
                 device: torch.device) -> None:
        self.cfg, self.task, self.trainer, self.reference, self.device = cfg, task, trainer, reference, device
        grpo = cfg.grpo
        self.max_age = max(grpo.max_staleness, grpo.partial.max_token_age if grpo.partial.enable else 0)
        """The most versions a trained token may be behind: grpo.partial's bound, else the staleness bound."""
        self.early: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[torch.Tensor, torch.Tensor | None]] = {}
        """generator.stream_groups: (prompt, completion) -> its pi_old (and reference) logprobs, recomputed one
        group at a time; the step's ``build`` uses and clears them."""
        self.score = functools.partial(  # (prompts, rollouts) -> Groups: rewards, overlong penalty, cut flags
            score_groups, task, group_size=grpo.group_size, max_tokens=cfg.generator.sampling.max_tokens,
            overlong=grpo.overlong, overlong_buffer=grpo.overlong_buffer,
            overlong_penalty_at_max=grpo.overlong_penalty, device=device,
        )

    def build(self, prompts: list[Prompt], rollouts, *,
              refill: Callable[[int, int], tuple[list[Prompt], object]], version: int = 0) -> StepBatch:
        """``refill(round, n)``: (prompts, rollouts) of dynamic sampling's extra draw ``round``, n prompts;
        ``version``: the weight version pi_old is (the step), from which tokens' versions are aged."""
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
        # Tensor-parallel peers share a data shard: split over data-parallel ranks only, by tokens.
        lengths = [len(p) + len(c) for p, c in zip(batch.prompt_ids, batch.completion_ids)]
        rows = rank_rows(lengths, rank=trainer.dp_rank, ranks=trainer.dp_size)
        ranks = self._rank_balance(sum(lengths[r] for r in rows.tolist()))
        tokens_BL, mask_BL, gen_lp_BL = tokens_BL[rows], mask_BL[rows], gen_lp_BL[rows]
        started = time.perf_counter()
        ref_lp_BL = replay_BLNK = routes_BLNK = gen_routes_BLNK = trainer_lp_BL = None
        # grpo.old_logprobs train: no recompute (trainer_lp_BL stays None); pi_old comes from the training forward
        if cfg.generator.stream_groups:  # one group at a time, as its early groups were (prefetch); dense only
            trainer_lp_BL, ref_lp_BL = self._by_group(batch, rows, mask_BL)
        elif cfg.grpo.old_logprobs == "recompute":
            gen_routes_BLNK = None if batch.routes is None else pack_routes(batch.routes, tokens_BL.shape[1])[rows]
            replay_BLNK = gen_routes_BLNK if cfg.grpo.routing_replay else None
            trainer_lp_BL, routes_BLNK = trainer.token_logprobs_and_routes(
                tokens_BL, temperature=temperature, mask_BL=mask_BL, replay_BLNK=replay_BLNK)
            trainer_lp_BL = trainer_lp_BL.cpu()
        recompute_s = time.perf_counter() - started
        routing = {}
        if routes_BLNK is not None and gen_routes_BLNK is not None:  # the trainer's choices vs the generator's
            routing = self._reduce_counts(routing_mismatch(routes_BLNK, gen_routes_BLNK), count="routing_tokens")
        mismatch = None  # grpo.old_logprobs train: train_step measures it (``mismatch_of``)
        if trainer_lp_BL is not None:
            mismatch = self.mismatch_of(self._reduce(logprob_mismatch(trainer_lp_BL, gen_lp_BL, mask_BL), mask_BL))
        # Partial rollouts and in-flight updates: a sequence's tokens may come from several versions; mu is each
        # token's own sampler (its generator logprob), so the correction below is per token whatever the mix.
        ages_BL = None
        if batch.versions is not None:
            ages_BL = version - pack_versions(batch.prompt_ids, batch.versions, length=tokens_BL.shape[1])[rows]
        # off-policy weight pi_old / mu of each token, capped (None: grpo.importance_correction off)
        if trainer_lp_BL is not None:
            is_weights_BL, is_stats = importance_weights(
                trainer_lp_BL, gen_lp_BL, mask_BL, mode=cfg.grpo.importance_correction, cap=cfg.grpo.importance_cap,
                level=cfg.grpo.ratio_level,  # GSPO corrects whole sequences, as it clips them
                ages_BT=ages_BL, max_age=self.max_age,
            )
        else:  # grpo.old_logprobs train: train_step weighs and measures with pi_old of its own forward
            is_weights_BL = None
            is_stats = {} if ages_BL is None else version_age_stats(ages_BL, mask_BL, max_age=self.max_age)
        is_stats = self._reduce(is_stats, mask_BL)
        if self.reference is not None and not cfg.generator.stream_groups:  # the frozen initial policy of the KL term
            started = time.perf_counter()
            ref_lp_BL = self.reference.token_logprobs(tokens_BL, temperature=temperature, mask_BL=mask_BL).cpu()
            recompute_s += time.perf_counter() - started
        return StepBatch(
            drawn=drawn,
            train=TrainBatch(tokens_BL, mask_BL, trainer_lp_BL, advantages_B[rows], ref_lp_BL, is_weights_BL,
                             generator_logprobs_BL=gen_lp_BL if trainer_lp_BL is None else None,
                             replay_routes_BLNK=replay_BLNK),
            rollout_stats=rollout_stats, sampling_stats=sampling_stats, mismatch=mismatch, importance=is_stats,
            routing=routing, recompute_s=recompute_s, ranks=ranks,
        )

    def measured_in_training(self, step: StepBatch, train: dict[str, float]) -> None:
        """grpo.old_logprobs train: move the logprob gap and the pi_old / mu statistics that train_step measured
        on its forward (no recompute ran) out of its metrics into ``step``, where the recompute puts them."""
        if step.mismatch is not None:
            return
        step.mismatch = self.mismatch_of({k: train.pop(k) for k in MISMATCH_KEYS})
        step.importance = {**{k: train.pop(k) for k in RATIO_KEYS}, **step.importance}

    def mismatch_of(self, measured: dict[str, float]) -> dict[str, float]:
        """The generator-vs-trainer logprob metrics as logged: NaN where the generator's logprobs are those of a
        top-p / top-k truncated distribution, which no full-vocabulary forward reproduces."""
        sampling = self.cfg.generator.sampling
        if sampling.top_p < 1 or sampling.top_k != -1:
            return dict.fromkeys(measured, float("nan"))
        return measured

    def _rank_balance(self, tokens: int) -> dict[str, float]:
        """StepBatch.ranks from this rank's ``tokens`` (tensor-parallel peers count their shared shard alike)."""
        if dist.get_world_size() == 1:
            return {}
        total = torch.tensor([tokens], dtype=torch.float64, device=self.device)
        most = total.clone()
        dist.all_reduce(total)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return {"train_rank_balance": total.item() / dist.get_world_size() / max(most.item(), 1.0)}

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

    def prefetch(self, groups: list[tuple[int, object]]) -> None:
        """generator.stream_groups: pi_old (and the reference's logprobs) of groups that finished while the step's
        other samples are still generated, kept for ``build`` (collective: every rank gets the same groups)."""
        for _, rollouts in groups:
            self._recompute(rollouts.prompt_ids, rollouts.completion_ids)

    def _recompute(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> None:
        """One group's rows through the trainer (and the reference): each data-parallel rank a block of them,
        gathered, so every rank holds them all. A group is recomputed alone whenever it finished, so its
        numbers do not depend on which groups streamed in together."""
        T, dp = self.cfg.generator.sampling.temperature, self.trainer.dp_size
        tokens_BL, mask_BL, _ = pack_rollouts(prompt_ids, completion_ids, [[0.0] * len(c) for c in completion_ids],
                                              pad_id=self.task.pad_id)
        share = -(-len(prompt_ids) // dp)
        a = min(len(prompt_ids), self.trainer.dp_rank * share)
        b = min(len(prompt_ids), a + share)
        mine = [model.token_logprobs(tokens_BL[a:b], temperature=T, mask_BL=mask_BL[a:b]).cpu()
                for model in (self.trainer, self.reference) if model is not None]
        parts = [(a, b, mine)]
        if dist.get_world_size() > 1:  # tensor-parallel peers send the same block twice: the same rows
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, (a, b, mine))
        for a, b, logprobs in parts:
            for r in range(a, b):
                n = len(prompt_ids[r]) + len(completion_ids[r])
                self.early[(tuple(prompt_ids[r]), tuple(completion_ids[r]))] = (
                    logprobs[0][r - a, :n], logprobs[1][r - a, :n] if len(logprobs) > 1 else None)

    def _by_group(self, batch: Groups, rows: torch.Tensor, mask_BL: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's rows' pi_old (and reference) logprobs from the groups recomputed alone: the early ones
        (``prefetch``), the others now; 0 off ``mask_BL``."""
        G = batch.group_size
        key = [(tuple(p), tuple(c)) for p, c in zip(batch.prompt_ids, batch.completion_ids)]
        for g in range(len(batch)):
            if any(k not in self.early for k in key[g * G:(g + 1) * G]):  # the same groups on every rank
                self._recompute(batch.prompt_ids[g * G:(g + 1) * G], batch.completion_ids[g * G:(g + 1) * G])
        trainer_BL = torch.zeros(mask_BL.shape)
        ref_BL = torch.zeros(mask_BL.shape) if self.reference is not None else None
        for i, r in enumerate(rows.tolist()):
            k = key[r]
            lp, ref = self.early[k]
            trainer_BL[i, : len(lp)] = lp
            if ref_BL is not None:
                ref_BL[i, : len(ref)] = ref
        self.early = {}
        scored = mask_BL.bool()
        return torch.where(scored, trainer_BL, 0.0), None if ref_BL is None else torch.where(scored, ref_BL, 0.0)

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
