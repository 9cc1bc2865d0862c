"""What the GRPO loop needs from a generator, whatever the layout: the one interface.

The loop (simple_grpo.py) holds a ``RolloutGenerator`` and never learns which
layout it has: colocated.py (an engine in trainer rank 0's process, or in every trainer rank's),
remote.py (the engine on its own torchrun rank, or several replicas),
server_client.py (a rollout server over HTTP), or any other that keeps the
contract below.

Every trainer rank calls every method, in the same order (the calls are
collective: the rollouts reach every rank). A ``sync`` changes the weights
only for requests made after it: a request submitted before a sync is
sampled with the weights before that sync, however late its result is
taken (the own-rank layout serves requests in order; the server may run
requests concurrently, and its ``sync`` waits for the ones made before it). This is what
lets the loop keep requests in flight while it trains (grpo.max_staleness)
and still know which weights each batch came from (``Rollouts.weight_version``).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from torchtitan_rl.config import SamplingConfig

if TYPE_CHECKING:  # annotations only: the interface module stays free of torch
    import torch


@dataclass
class Rollouts:
    prompt_ids: list[list[int]]
    """One entry per completion (prompts repeated n times, group-contiguous)."""
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    """Generator logprob of each sampled token (after temperature); 0 where loss_mask is 0."""
    weight_version: int
    generate_s: float = 0.0
    """Seconds the engine spent on this batch."""
    idle_s: float = 0.0
    """Seconds the engine had nothing to do (no batch, no sync) between its previous batch and this one."""
    loss_mask: list[list[int]] | None = None
    """Multi-turn episodes: 1 on the policy's tokens, 0 on a tool's (not trained on); None: all 1."""

    @staticmethod
    def concat(parts: list["Rollouts"]) -> "Rollouts":
        """Rollouts of consecutive prompt blocks (one per generator replica) as one batch, in block order.

        All parts come from one weight version: every replica applies the same
        syncs between the same requests. ``generate_s`` is the slowest part's
        (the batch is ready when it is); ``idle_s`` the mean over the parts.
        """
        assert len({p.weight_version for p in parts}) == 1, [p.weight_version for p in parts]
        masks = None
        if any(p.loss_mask is not None for p in parts):
            masks = [m for p in parts for m in (p.loss_mask or [[1] * len(c) for c in p.completion_ids])]
        return Rollouts(
            prompt_ids=[x for p in parts for x in p.prompt_ids],
            completion_ids=[x for p in parts for x in p.completion_ids],
            logprobs=[x for p in parts for x in p.logprobs],
            weight_version=parts[0].weight_version,
            generate_s=max(p.generate_s for p in parts),
            idle_s=sum(p.idle_s for p in parts) / len(parts),
            loss_mask=masks,
        )


def prompt_blocks(prompts: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, end) blocks of ``prompts``, sizes differing by at most one (larger first)."""
    size, extra = divmod(prompts, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (i < extra))
    return list(zip(bounds[:-1], bounds[1:]))


class Pending(Protocol):
    def result(self) -> Rollouts:
        """The request's rollouts, waiting for them if needed; the same object every call."""


class RolloutGenerator(Protocol):
    def sync(self, state: "dict[str, torch.Tensor]", *, version: int) -> float:
        """Weights for the requests submitted from now on, served as ``version``; seconds the
        transfer took (not counting this trainer's wait for its earlier requests; a rollout server's
        drain of other clients' requests in flight is counted)."""

    def submit(self, prompts: list[list[int]], *, n: int, stop_token_ids: list[int] | None = None,
               seed: int | None = None, sampling: SamplingConfig | None = None) -> Pending:
        """Ask for ``n`` completions per prompt (Generator.generate's arguments); returns at once
        where the layout can generate meanwhile."""

    def rollouts(self, prompts: list[list[int]], **generate_kwargs) -> Rollouts:
        """``submit(...).result()``: ask and wait."""

    def close(self) -> None:
        """Shut the engine down (also after an error in the loop)."""


class Done:
    """A Pending whose rollouts are already here (generated at submit, or restored from a checkpoint)."""

    def __init__(self, rollouts: Rollouts) -> None:
        self.rollouts = rollouts

    def result(self) -> Rollouts:
        return self.rollouts


class Later:
    """A Pending whose rollouts ``fetch`` gets on the first ``result()`` (a collective call in the layouts
    that broadcast them to every trainer rank), kept for the calls after it."""

    def __init__(self, fetch: Callable[[], Rollouts]) -> None:
        self.fetch = fetch
        self.rollouts: Rollouts | None = None

    def result(self) -> Rollouts:
        if self.rollouts is None:
            self.rollouts = self.fetch()
        return self.rollouts
