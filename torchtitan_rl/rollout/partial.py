"""Partial rollouts (grpo.partial): the groups a step's generate left unfinished, kept for the next one.

A request holds whole groups, oldest first (dealt, below): the ones this buffer carries, then new prompts up to
grpo.prompts_per_step + grpo.partial.over_sample. The engine stops it once prompts_per_step of them are
finished (with every group marked due, and the token budget spent) and returns every sample, the cut ones
with their tokens, generator logprobs and per-token weight versions so far (engine/rollouts.py's
PartialRequest). The oldest prompts_per_step finished groups train; the other groups wait here and join the
next request, whose engine resubmits each unfinished sample as prompt + completion so far (re-prefilled
under the weights of then). The bound, grpo.partial.max_token_age = A: request j trains at step j, and a
group carried from it joins request j + S + 1 at the earliest (S = grpo.max_staleness); a group whose oldest
token would then be more than A versions old is due (the request runs it to its end), and one already past
A when a request is built is dropped (counted; with A >= 2S + 1 only a resume under a smaller A drops).
Where several engines split a request into contiguous blocks (colocated on every rank, generator replicas),
the request deals its groups to them in turn, so that each engine gets its share of the carried groups (the
long samples) and of the new ones, rather than the first engine all the carried ones.
docs/design.md, "Partial rollouts and in-flight updates".
"""

from dataclasses import dataclass

from torchtitan_rl.config import JobConfig
from torchtitan_rl.engine.rollouts import PartialRequest, Rollouts
from torchtitan_rl.grpo.tasks.base import Prompt


@dataclass
class Group:
    """One prompt's group of samples, from its first request until it trains."""

    number: int
    """Its place in the run's order of groups (oldest first), and its samples' seeds."""
    prompt: Prompt
    so_far: Rollouts | None = None
    """Its group_size samples so far (finished or cut); None: not started."""

    def oldest_version(self) -> int | None:
        """The weight version of its oldest token; None before its first token."""
        versions = [v[0] for v in (self.so_far.token_versions() if self.so_far else []) if v]
        return min(versions) if versions else None

    def finished(self) -> bool:
        return self.so_far is not None and all(self.so_far.finished or [True] * len(self.so_far.completion_ids))


@dataclass
class Pool:
    """One request's groups, and what building it dropped."""

    groups: list[Group]
    request: PartialRequest
    dropped_samples: int = 0
    """Samples of carried groups already past the bound when the request was built."""


class UnfinishedBuffer:
    """The groups between requests (not in flight), oldest first; a checkpoint keeps them."""

    def __init__(self, cfg: JobConfig, *, engines: int = 1) -> None:
        """``engines``: how many contiguous blocks the generator splits a request into (RolloutGenerator.engines)."""
        self.cfg = cfg
        self.engines = engines
        self.groups: list[Group] = []
        self.next_number = 0
        """The number the next new group gets."""
        self.stats: dict[str, float] = {}
        """The last ``take``'s metrics."""

    def new_groups_wanted(self) -> int:
        """New prompts the next request takes: up to prompts_per_step + over_sample groups in all."""
        grpo = self.cfg.grpo
        return max(0, grpo.prompts_per_step + grpo.partial.over_sample - len(self.groups))

    def request(self, j: int, new_prompts: list[Prompt], *, seed: int) -> tuple[Pool, dict]:
        """Request ``j``'s pool (every carried group, then ``new_prompts``, dealt to the engines) and
        Engine.generate's arguments."""
        grpo, partial = self.cfg.grpo, self.cfg.grpo.partial
        A, S, G = partial.max_token_age, grpo.max_staleness, grpo.group_size
        carried, dropped = [], 0
        for group in self.groups:
            v = group.oldest_version()
            if v is not None and j - v > A:  # too old to train even now (a resume under a smaller bound)
                dropped += G
            else:
                carried.append(group)
        self.groups = []
        for prompt in new_prompts:
            carried.append(Group(self.next_number, prompt))
            self.next_number += 1
        carried = dealt(carried, self.engines)
        # The next request that could continue a group cut now trains at step j + S + 1.
        due = [(v := g.oldest_version()) is not None and j + S + 1 - v > A for g in carried]
        so_far = _join([g.so_far or _unstarted(g.prompt, G) for g in carried])
        request = PartialRequest(so_far=so_far, groups=[g.number for g in carried], need=grpo.prompts_per_step,
                                 due=due, token_budget=partial.token_budget)
        pool = Pool(carried, request, dropped_samples=dropped)
        return pool, {"prompts": [g.prompt.token_ids for g in carried], "n": G, "seed": seed, "partial": request}

    def take(self, pool: Pool, rollouts: Rollouts) -> tuple[list[Prompt], Rollouts]:
        """The oldest prompts_per_step finished groups of ``pool`` (``rollouts``: all its samples after the
        generate) as the step's batch; the other groups stay here (due ones not taken are dropped)."""
        P, G = self.cfg.grpo.prompts_per_step, self.cfg.grpo.group_size
        before = sum(map(len, pool.request.so_far.completion_ids))
        for i, group in enumerate(pool.groups):
            group.so_far = rollouts.rows(i * G, (i + 1) * G)
        done = sorted((i for i, g in enumerate(pool.groups) if g.finished()), key=lambda i: pool.groups[i].number)
        assert len(done) >= P, f"the engine stopped with {len(done)} of the {P} groups a step needs finished"
        chosen = done[:P]  # the oldest: a group's number is its place in the run's order
        taken = set(chosen)
        dropped, kept = pool.dropped_samples, []
        for i, group in enumerate(pool.groups):
            if i in taken:
                continue
            if pool.request.due[i]:  # only when more groups were due than a step trains
                dropped += G
            else:
                kept.append(group)
        self.groups = sorted(self.groups + kept, key=lambda g: g.number)
        batch = Rollouts.concat([pool.groups[i].so_far for i in chosen])
        batch.finished = None
        # The step's own generate: its timings and trace (engine/trace.py), however many requests its groups span.
        batch.weight_version, batch.generate_s = rollouts.weight_version, rollouts.generate_s
        batch.idle_s = rollouts.idle_s
        batch.trace = rollouts.trace
        batch.generated = sum(map(len, rollouts.completion_ids)) - before
        cut = [(g.so_far, b) for g in kept for b, f in enumerate(g.so_far.finished) if f is False]
        self.stats = {
            "partial_carried_samples": float(len(cut)),
            # what the next generate prefills again to continue them (their old K/V are the old weights')
            "partial_carried_tokens": float(sum(len(r.prompt_ids[b]) + len(r.completion_ids[b]) for r, b in cut)),
            "partial_carried_groups": float(len(kept)),
            "partial_dropped_samples": float(dropped),
            "partial_due_groups": float(sum(pool.request.due)),
        }
        return [pool.groups[i].prompt for i in chosen], batch

    def state_dict(self) -> dict:
        return {"groups": self.groups, "next_number": self.next_number}

    def load_state_dict(self, state: dict) -> None:
        self.groups, self.next_number = list(state["groups"]), state["next_number"]


def dealt(groups: list[Group], engines: int) -> list[Group]:
    """``groups`` (oldest first) reordered so that engine e's contiguous block (rollout/base.py's prompt_blocks:
    sizes differing by at most one, larger first) holds groups e, e + engines, e + 2 x engines, ...: every engine
    a share of each age."""
    return [groups[i] for e in range(engines) for i in range(e, len(groups), engines)]


def _unstarted(prompt: Prompt, n: int) -> Rollouts:
    """``n`` samples of ``prompt`` with no token yet."""
    return Rollouts([list(prompt.token_ids) for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)],
                    weight_version=-1, versions=[[] for _ in range(n)], finished=[False] * n)


def _join(parts: list[Rollouts]) -> Rollouts:
    """Groups of several requests as one request's samples so far (their versions per token; no timings)."""
    return Rollouts(
        prompt_ids=[x for p in parts for x in p.prompt_ids],
        completion_ids=[x for p in parts for x in p.completion_ids],
        logprobs=[x for p in parts for x in p.logprobs],
        weight_version=-1,
        versions=[x for p in parts for x in p.token_versions()],
        finished=[x for p in parts for x in p.finished],
    )
