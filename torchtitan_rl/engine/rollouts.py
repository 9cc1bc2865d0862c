"""What a generator returns: a batch of rollouts (the engine's output type, used by every layer above it).

It lives with the engine, the lowest package that makes rollouts, so that grpo/ and rollout/ read it
downward (rollout/base.py re-exports it with the loop's interface).
"""

from collections.abc import Callable
from dataclasses import dataclass

from torchtitan_rl.engine.trace import EngineTrace


@dataclass
class Rollouts:
    prompt_ids: list[list[int]]
    """One entry per completion (prompts repeated n times, group-contiguous)."""
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    """Engine logprob of each sampled token (after temperature); 0 where loss_mask is 0."""
    weight_version: int
    generate_s: float = 0.0
    """Seconds the engine spent on this batch."""
    idle_s: float = 0.0
    """Seconds the engine had nothing to do (no batch, no sync) between its previous batch and this one."""
    loss_mask: list[list[int]] | None = None
    """Multi-turn episodes: 1 on the policy's tokens, 0 on a tool's (not trained on); None: all 1."""
    routes: list | None = None
    """MoE: per completion, int16 numpy [prompt + completion - 1, MoE layers, top-k], the experts the generator's
    forward chose at each position it computed (-1: none recorded); None for a dense model or a generator that
    does not hand them over (routing replay, the routing-mismatch metric)."""
    trace: EngineTrace | None = None
    """Where the engine's time went (engine/trace.py: the tail, the batch fill, preemptions); None where no
    Engine.generate made the batch (a rollout server's, a multi-turn episode's)."""
    versions: list[list[int]] | None = None
    """Weight version each completion token was sampled with (partial rollouts, in-flight updates: a sample may
    span several); None: every token's is ``weight_version``."""
    finished: list[bool] | None = None
    """Whether each sample ended (a stop token or its length limit); False: a partial rollout its request's stop
    rule cut, to continue later. None: all ended."""
    generated: int | None = None
    """Tokens the request that made this batch sampled (partial rollouts: the batch holds earlier requests' tokens
    too, and leaves this request's unfinished samples out); None: all of ``completion_ids``."""

    def token_versions(self) -> list[list[int]]:
        """The weight version of every completion token, sample by sample."""
        if self.versions is not None:
            return self.versions
        return [[self.weight_version] * len(c) for c in self.completion_ids]

    def generated_tokens(self) -> int:
        """Tokens sampled for this batch by the request that made it (see ``generated``)."""
        return sum(map(len, self.completion_ids)) if self.generated is None else self.generated

    def rows(self, a: int, b: int) -> "Rollouts":
        """Samples [a, b) (their timings as the whole batch's)."""
        return Rollouts(
            prompt_ids=self.prompt_ids[a:b], completion_ids=self.completion_ids[a:b], logprobs=self.logprobs[a:b],
            weight_version=self.weight_version, generate_s=self.generate_s, idle_s=self.idle_s,
            loss_mask=None if self.loss_mask is None else self.loss_mask[a:b],
            versions=None if self.versions is None else self.versions[a:b],
            finished=None if self.finished is None else self.finished[a:b],
            routes=None if self.routes is None else self.routes[a:b],
        )

    @staticmethod
    def concat(parts: list["Rollouts"]) -> "Rollouts":
        """Rollouts of consecutive prompt blocks (one per generator replica) as one batch, in block order.

        All parts come from one weight version: every replica applies the same
        syncs between the same requests. ``generate_s`` is the slowest part's
        (the batch is ready when it is); ``idle_s`` the mean over the parts;
        the traces are summed (EngineTrace.merge).
        """
        assert len({p.weight_version for p in parts}) == 1, [p.weight_version for p in parts]
        masks = None
        if any(p.loss_mask is not None for p in parts):
            masks = [m for p in parts for m in (p.loss_mask or [[1] * len(c) for c in p.completion_ids])]
        versions = finished = None
        if any(p.versions is not None for p in parts):
            versions = [v for p in parts for v in p.token_versions()]
        if any(p.finished is not None for p in parts):
            finished = [f for p in parts for f in (p.finished or [True] * len(p.completion_ids))]
        return Rollouts(
            prompt_ids=[x for p in parts for x in p.prompt_ids],
            completion_ids=[x for p in parts for x in p.completion_ids],
            logprobs=[x for p in parts for x in p.logprobs],
            weight_version=parts[0].weight_version,
            generate_s=max(p.generate_s for p in parts),
            idle_s=sum(p.idle_s for p in parts) / len(parts),
            loss_mask=masks,
            routes=None if any(p.routes is None for p in parts) else [r for p in parts for r in p.routes],
            trace=EngineTrace.merge([p.trace for p in parts]) if all(p.trace is not None for p in parts) else None,
            versions=versions,
            finished=finished,
            generated=None if all(p.generated is None for p in parts) else sum(p.generated_tokens() for p in parts),
        )


@dataclass
class SyncPoint:
    """generator.inflight_updates: how Engine.generate lands syncs between two engine iterations of a generate."""

    pending: Callable[[], bool]
    """Whether a sync waits (read after every engine step)."""
    apply: Callable[[], None]
    """Receive and apply the syncs that wait, called once no iteration is in flight: with async scheduling the
    engine first stops scheduling and collects the batch in flight (compat.pause_scheduling), then resumes."""


@dataclass
class PartialRequest:
    """What a partial-rollouts request (grpo.partial) adds to Engine.generate's ``prompts`` x ``n``: each
    sample's tokens so far, each prompt's group number, and when the generate may stop (rollout/partial.py
    makes it, the engine reads it)."""

    so_far: Rollouts
    """``n`` per prompt, group-contiguous: each sample's completion so far (empty: a new sample), its logprobs and
    versions, and whether it already finished (then the engine returns it as is)."""
    groups: list[int]
    """Each prompt's group number, which seeds its samples (whatever its place in this request)."""
    need: int
    """The generate may stop once this many of its groups (all ``n`` samples) are finished, ..."""
    due: list[bool]
    """... every group marked here (one entry per prompt) among them, ..."""
    token_budget: int = 0
    """... and it has sampled this many tokens (or every sample has finished)."""

    def block(self, a: int, b: int, *, n: int) -> "PartialRequest":
        """The request of prompts [a, b) only (one generator's block); it needs its share of ``need``, rounded
        up, so the blocks together still finish ``need`` groups."""
        total = len(self.groups)
        return PartialRequest(
            so_far=self.so_far.rows(a * n, b * n), groups=self.groups[a:b],
            need=-(-self.need * (b - a) // max(total, 1)), due=self.due[a:b],
            token_budget=-(-self.token_budget * (b - a) // max(total, 1)),
        )


class Done:
    """A Pending whose rollouts are already here (generated at submit, or restored from a checkpoint)."""

    def __init__(self, rollouts: Rollouts) -> None:
        self.rollouts = rollouts

    def result(self) -> Rollouts:
        return self.rollouts
