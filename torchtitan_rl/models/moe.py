"""torchtitan's top-k router, able to record its expert choices and to replay given ones (MoE families).

The trainer and the generator route with this one class (the generator's fused layer in engine/moe.py
holds it under the trainer's name), so both compute the same fp32 router scores from the same weights.
Recording gives the trainer's choices for the routing-mismatch metric; replay (routing replay, "R3") makes a
forward use the generator's choices while the gate weights still come from this router's own scores, so
the router's gradient flows through the chosen experts' weights.
"""

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchtitan.models.common.moe import TokenChoiceTopKRouter


COUNTER = "tokens_per_expert_E"
"""torchtitan's per-layer token counter (a buffer): bookkeeping for load balancing, computed with by nobody,
so the sync leaves it out on both sides."""


ROUTING_BIAS = "expert_bias_E"
"""torchtitan's per-layer routing bias (a buffer; model.moe_load_balance_coeff > 0): trained state, so a checkpoint
keeps it as it keeps the parameters."""


def synced(name: str) -> bool:
    """Whether a parameter or buffer of this name is part of the model the generator computes with."""
    return not name.endswith(COUNTER)


def synced_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers the generator computes with, by name: what the sync moves."""
    return {name: t for name, t in [*model.named_parameters(), *model.named_buffers()] if synced(name)}


class Router(TokenChoiceTopKRouter):
    """torchtitan's TokenChoiceTopKRouter plus ``replay_BLK`` (expert ids to use; a row with any -1 routes as
    usual) and ``record`` (keep this forward's own choices in ``recorded_BLK``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TokenChoiceTopKRouter.Config):
        pass

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.replay_BLK: torch.Tensor | None = None
        self.record = False
        self.recorded_BLK: torch.Tensor | None = None

    def forward(self, x_BLD: torch.Tensor, expert_bias_E: torch.Tensor | None = None):
        """torchtitan's softmax top-k routing (its forward without expert groups), the gate in fp32 on every
        device (torchtitan asks autocast for it, which CPU autocast ignores), then replay and recording."""
        assert self.num_expert_groups is None and not self._debug_force_load_balance
        scores_BLE = F.linear(x_BLD.float(), self.gate.weight.float())
        scores_BLE = torch.sigmoid(scores_BLE) if self.score_func == "sigmoid" else F.softmax(scores_BLE, dim=-1)
        choice_BLE = scores_BLE if expert_bias_E is None else scores_BLE + expert_bias_E
        _, ids_BLK = torch.topk(choice_BLE, k=self.top_k, dim=-1, sorted=False)
        if self.record:
            self.recorded_BLK = ids_BLK.detach()
        if self.replay_BLK is not None:
            given_BLK = self.replay_BLK.to(device=ids_BLK.device, dtype=ids_BLK.dtype)
            ids_BLK = torch.where((given_BLK >= 0).all(dim=-1, keepdim=True), given_BLK, ids_BLK)
        # The bias only picks experts; gate weights are the chosen experts' own scores.
        topk_scores_BLK = scores_BLE.gather(dim=-1, index=ids_BLK)
        if self.route_norm:
            topk_scores_BLK = topk_scores_BLK / (topk_scores_BLK.sum(dim=-1, keepdim=True) + 1e-20)
        return topk_scores_BLK * self.route_scale, ids_BLK, scores_BLE


def routers(model: nn.Module) -> list[Router]:
    """The model's routers in layer order (one per MoE layer; empty for a dense model)."""
    return [m for m in model.modules() if isinstance(m, Router)]


@contextlib.contextmanager
def routing(model_routers: list[Router], *, replay_BLNK: torch.Tensor | None = None, record: bool = False):
    """Forwards inside replay ``replay_BLNK[:, :, n]`` at MoE layer n (int, -1: the router's own choice) and,
    with ``record``, keep each router's own choices; everything is cleared on exit."""
    try:
        for n, router in enumerate(model_routers):
            router.replay_BLK = None if replay_BLNK is None else replay_BLNK[:, :, n]
            router.record = record
        yield
    finally:
        for router in model_routers:
            router.replay_BLK, router.record = None, False


def recorded(model_routers: list[Router]) -> torch.Tensor:
    """[B, L, N, K] the expert ids each router chose in the last recorded forward."""
    return torch.stack([r.recorded_BLK for r in model_routers], dim=2)
