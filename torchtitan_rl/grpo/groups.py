"""A step's scored groups: rewards computed once and shared, overlong handling, DAPO's dynamic sampling.

The loop's steps 3-4 (score, advantages) in pieces a reader can check one by
one: ``score_groups`` turns rollouts into ``Groups`` (every rank scores a
slice of the completions and all ranks gather them, so every rank trains on
the same rewards even where a reward's time limit is wall-clock);
``fill_with_signal`` keeps the groups whose accuracy varies (DAPO's filter:
some completions right, some wrong) and draws the prompts still missing
until the batch is full (docs/design.md, "Dynamic sampling").
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from torchtitan_rl.grpo.tasks.base import Prompt, Task

@dataclass
class Groups:
    """Scored completions of whole groups, group-contiguous (group g: rows [g * G, (g + 1) * G))."""

    group_size: int
    prompts: list[Prompt]
    """One per group."""
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    """The generator's logprob of each sampled token."""
    loss_mask: list[list[int]] | None
    """Multi-turn episodes: 1 on the policy's tokens; None: all 1."""
    task_rewards_B: Tensor
    """float32: the task's reward of each completion."""
    rewards_B: Tensor
    """float32: what the advantages see, task_rewards_B plus the overlong penalty (if any)."""
    truncated_B: Tensor
    """bool: the completion was cut at the length limit (no eos)."""
    correct_B: Tensor
    """bool: the task calls the completion correct (Task.correct): what DAPO's filter reads."""
    routes: list | None = None
    """MoE: the generator's expert choices of each completion (engine/rollouts.py); None: not handed over."""
    versions: list[list[int]] | None = None
    """The weight version of each completion token (Rollouts.versions); None: the batch's one version."""

    def __len__(self) -> int:
        return len(self.prompts)

    def uniform(self) -> Tensor:
        """bool [groups]: all completions of the group are right, or all wrong (DAPO's filter: accuracy 0 or
        1). A format bonus or a length penalty may still make its rewards differ; the group is dropped anyway."""
        correct_PG = self.correct_B.view(-1, self.group_size)
        return (correct_PG == correct_PG[:, :1]).all(dim=1)

    def select(self, groups: list[int]) -> "Groups":
        G = self.group_size
        rows = [g * G + i for g in groups for i in range(G)]
        return Groups(
            group_size=G,
            prompts=[self.prompts[g] for g in groups],
            prompt_ids=[self.prompt_ids[r] for r in rows],
            completion_ids=[self.completion_ids[r] for r in rows],
            logprobs=[self.logprobs[r] for r in rows],
            loss_mask=None if self.loss_mask is None else [self.loss_mask[r] for r in rows],
            task_rewards_B=self.task_rewards_B[rows],
            rewards_B=self.rewards_B[rows],
            truncated_B=self.truncated_B[rows],
            correct_B=self.correct_B[rows],
            routes=None if self.routes is None else [self.routes[r] for r in rows],
            versions=None if self.versions is None else [self.versions[r] for r in rows],
        )

    @staticmethod
    def concat(parts: list["Groups"]) -> "Groups":
        masks = None
        if any(p.loss_mask is not None for p in parts):
            masks = [m for p in parts for m in (p.loss_mask or [[1] * len(c) for c in p.completion_ids])]
        return Groups(
            group_size=parts[0].group_size,
            prompts=[x for p in parts for x in p.prompts],
            prompt_ids=[x for p in parts for x in p.prompt_ids],
            completion_ids=[x for p in parts for x in p.completion_ids],
            logprobs=[x for p in parts for x in p.logprobs],
            loss_mask=masks,
            task_rewards_B=torch.cat([p.task_rewards_B for p in parts]),
            rewards_B=torch.cat([p.rewards_B for p in parts]),
            truncated_B=torch.cat([p.truncated_B for p in parts]),
            correct_B=torch.cat([p.correct_B for p in parts]),
            routes=None if any(p.routes is None for p in parts) else [r for p in parts for r in p.routes],
            versions=_joined_versions(parts),
        )


def _joined_versions(parts: list[Groups]) -> list[list[int]] | None:
    """The parts' per-token versions, in order; None when no part has any (a part without takes none)."""
    if all(p.versions is None for p in parts):
        return None
    assert all(p.versions is not None for p in parts), "per-token versions on some parts only"
    return [v for p in parts for v in p.versions]


def shared_scores(score: Callable[[int], tuple[float, ...]], n: int, *, device: torch.device) -> Tensor:
    """float32 [n, k]: ``score(i)`` (k floats) for every i, each computed on exactly one rank of the default
    group (rank r: a contiguous r-th share) and gathered, so every rank holds the same values."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return torch.tensor([score(i) for i in range(n)], dtype=torch.float64).float()
    world, rank = dist.get_world_size(), dist.get_rank()
    share = math.ceil(n / world)
    mine = [score(i) for i in range(rank * share, min(n, (rank + 1) * share))]
    k = len(score(0)) if not mine else len(mine[0])
    # float64: the Python floats cross the wire exactly, then round to float32 as torch.tensor(list) does.
    local = torch.zeros(share, k, dtype=torch.float64, device=device)
    local[: len(mine)] = torch.tensor(mine, dtype=torch.float64).reshape(len(mine), k)
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    return torch.cat(gathered)[:n].cpu().float()


def truncated(completion_ids: list[list[int]], *, max_tokens: int, eos_id: int) -> Tensor:
    """bool [B]: completions of max_tokens (or more: a multi-turn episode's) tokens that do not end in eos."""
    return torch.tensor([len(c) >= max_tokens and (not c or c[-1] != eos_id) for c in completion_ids])


def overlong_penalty(lengths_B: Tensor, *, max_tokens: int, buffer: int, penalty: float) -> Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): 0 up to max_tokens - buffer tokens, then
    falling linearly to -penalty at max_tokens (and below it past max_tokens)."""
    excess_B = (lengths_B.float() - (max_tokens - buffer)).clamp(min=0)
    return -penalty * (excess_B / buffer).clamp(max=1.0)


def score_groups(
    task: Task, prompts: list[Prompt], rollouts, *, group_size: int, max_tokens: int, overlong: str,
    overlong_buffer: int, overlong_penalty_at_max: float, device: torch.device,
) -> Groups:
    """``rollouts`` (group-contiguous, ``group_size`` per prompt) scored once over all ranks, with the
    overlong penalty added to the rewards when grpo.overlong is soft_penalty."""
    G = group_size
    completions = rollouts.completion_ids
    # The reward and the verdict of each completion (math-verify caches the second read of a text).
    scores_B2 = shared_scores(lambda i: (task.reward(prompts[i // G], completions[i]),
                                         float(task.correct(prompts[i // G], completions[i]))),
                              len(completions), device=device)
    task_rewards_B, correct_B = scores_B2[:, 0].contiguous(), scores_B2[:, 1] == 1.0
    truncated_B = truncated(completions, max_tokens=max_tokens, eos_id=task.eos_id)
    rewards_B = task_rewards_B
    if overlong == "soft_penalty":
        lengths_B = torch.tensor([len(c) for c in completions])
        rewards_B = task_rewards_B + overlong_penalty(
            lengths_B, max_tokens=max_tokens, buffer=overlong_buffer, penalty=overlong_penalty_at_max
        )
    return Groups(
        group_size=G, prompts=list(prompts), prompt_ids=rollouts.prompt_ids, completion_ids=completions,
        logprobs=rollouts.logprobs, loss_mask=rollouts.loss_mask, task_rewards_B=task_rewards_B,
        rewards_B=rewards_B, truncated_B=truncated_B, correct_B=correct_B, routes=rollouts.routes,
        versions=rollouts.versions,
    )


def fill_with_signal(first: Groups, draw: Callable[[int, int], Groups], *, want: int,
                     max_rounds: int) -> tuple[Groups, dict[str, float]]:
    """DAPO's dynamic sampling: ``want`` groups whose accuracy varies (``Groups.uniform``), from ``first``
    and up to ``max_rounds`` more draws of just the groups still missing (``draw(round, n)``: round 1, 2,
    ..., n prompts), in the order drawn. Still short after the last round, the batch is topped up with
    dropped groups (trained as plain GRPO trains them: advantage 0 unless a format bonus or length penalty
    makes their rewards differ).

    Returns the batch (exactly ``want`` groups) and metrics: groups_dropped (groups without signal seen),
    groups_padded (of them put back), sampling_rounds (extra rounds drawn), refill_prompts (prompts they
    drew), refill_completion_tokens (tokens they generated).
    """
    kept, dropped, rounds, seen, refill_prompts, refill_tokens = [], [], 0, first, 0, 0
    while True:
        uniform = seen.uniform().tolist()
        kept.append(seen.select([g for g, u in enumerate(uniform) if not u]))
        dropped.append(seen.select([g for g, u in enumerate(uniform) if u]))
        missing = want - sum(map(len, kept))
        if missing <= 0 or rounds == max_rounds:
            break
        rounds += 1
        seen = draw(rounds, missing)
        assert len(seen) == missing, (len(seen), missing)
        refill_prompts += missing
        refill_tokens += sum(map(len, seen.completion_ids))
    batch = Groups.concat(kept)
    n_dropped = sum(map(len, dropped))
    padded = max(0, want - len(batch))
    batch = Groups.concat([batch, *dropped]).select(list(range(want)))
    return batch, {"groups_dropped": float(n_dropped), "groups_padded": float(padded),
                   "sampling_rounds": float(rounds), "refill_prompts": float(refill_prompts),
                   "refill_completion_tokens": float(refill_tokens)}


def rollout_metrics(groups: Groups) -> dict[str, float]:
    """What a researcher reads beside the mean reward: its spread (overall and per task level, where
    prompts have one), the share of right answers (the held-out evaluation's verdict: a reward with a format
    bonus can rise while it does not), response lengths and the share cut at the length limit."""
    lengths_B = torch.tensor([len(c) for c in groups.completion_ids], dtype=torch.float64)
    rewards_B = groups.task_rewards_B.double()
    metrics = {
        "reward_std": rewards_B.std(unbiased=False).item(),
        "correct_frac": groups.correct_B.double().mean().item(),
        "response_length_mean": lengths_B.mean().item(),
        "response_length_max": lengths_B.max().item(),
        "response_length_p90": torch.quantile(lengths_B, 0.9).item(),
        "truncated_frac": groups.truncated_B.double().mean().item(),
    }
    levels_B = torch.tensor([-1 if p.level is None else p.level for p in groups.prompts]).repeat_interleave(
        groups.group_size
    )
    for level in sorted(set(levels_B.tolist()) - {-1}):
        at = rewards_B[levels_B == level]
        metrics[f"reward_mean/level_{level}"] = at.mean().item()
        metrics[f"reward_std/level_{level}"] = at.std(unbiased=False).item()
    return metrics
