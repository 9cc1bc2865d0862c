"""What a generator returns: a batch of rollouts (the engine's output type, used by every layer above it).

It lives with the engine, the lowest package that makes rollouts, so that grpo/ and rollout/ read it
downward (rollout/base.py re-exports it with the loop's interface).
"""

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
        )


class Done:
    """A Pending whose rollouts are already here (generated at submit, or restored from a checkpoint)."""

    def __init__(self, rollouts: Rollouts) -> None:
        self.rollouts = rollouts

    def result(self) -> Rollouts:
        return self.rollouts
