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
With generator.inflight_updates (own-rank layout) a sync also reaches the request
running on a replica, from its next engine step on; its tokens then record their
versions one by one (``Rollouts.versions``).
"""

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from torchtitan_rl.config import SamplingConfig
from torchtitan_rl.engine.rollouts import Done, Rollouts

__all__ = ["Done", "Later", "Pending", "RolloutGenerator", "Rollouts", "block_request", "prompt_blocks"]

if TYPE_CHECKING:  # annotations only: the interface module stays free of torch
    import torch


def prompt_blocks(prompts: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, end) blocks of ``prompts``, sizes differing by at most one (larger first)."""
    size, extra = divmod(prompts, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (i < extra))
    return list(zip(bounds[:-1], bounds[1:]))


def block_request(prompts: list[list[int]], generate_kwargs: dict, a: int, b: int) -> tuple[list[list[int]], dict]:
    """Prompts [a, b) of a request and Engine.generate's arguments for them alone: ``first_prompt`` a, and a
    partial-rollouts request (``partial``) cut to its block."""
    kwargs = {**generate_kwargs, "first_prompt": a}
    if kwargs.get("partial") is not None:
        kwargs["partial"] = kwargs["partial"].block(a, b, n=kwargs["n"])
    return prompts[a:b], kwargs


class Pending(Protocol):
    def result(self) -> Rollouts:
        """The request's rollouts, waiting for them if needed; the same object every call."""


class RolloutGenerator(Protocol):
    engines: int
    """Engines a request is split over, each generating a contiguous block of its prompts (``prompt_blocks``)."""

    def sync(self, state: "dict[str, torch.Tensor]", *, version: int) -> float:
        """Weights for the requests submitted from now on, served as ``version``; seconds the
        transfer took (not counting this trainer's wait for its earlier requests; a rollout server's
        drain of other clients' requests in flight is counted)."""

    def submit(self, prompts: list[list[int]], *, n: int, stop_token_ids: list[int] | None = None,
               seed: int | None = None, sampling: SamplingConfig | None = None) -> Pending:
        """Ask for ``n`` completions per prompt (Engine.generate's arguments); returns at once
        where the layout can generate meanwhile."""

    def rollouts(self, prompts: list[list[int]], **generate_kwargs) -> Rollouts:
        """``submit(...).result()``: ask and wait."""

    def close(self) -> None:
        """Shut the engine down (also after an error in the loop)."""


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
