"""The Qwen3 MoE family: Qwen3MoeForCausalLM checkpoints, its shapes by name, and the experts' layouts.

torchtitan's Qwen3 decoder with every MLP a mixture of experts as torchtitan's Qwen3 MoE flavors build it
(``debugmodel_moe``, ``30B-A3B``): a softmax top-k router (fp32 scores, renormalised top-k), no shared
expert, and the experts stacked per layer: ``w1_EFD`` (gate), ``w3_EFD`` (up) [experts, hidden, dim] and
``w2_EDF`` (down) [experts, dim, hidden]. HF names (one tensor per expert) map through torchtitan's
Qwen3StateDictAdapter, which splits and stacks them.
"""

import dataclasses

import torch

from torchtitan_rl.models import qwen3
from torchtitan_rl.models.qwen3 import QWEN3
from torchtitan_rl.models.shape import ModelShape

QWEN3_MOE = dataclasses.replace(
    QWEN3,
    name="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    # Every layer sparse (decoder_sparse_step 1, no mlp_only_layers); the router's aux loss is not ours.
    hf_config_extra={**QWEN3.hf_config_extra, "decoder_sparse_step": 1, "mlp_only_layers": [],
                     "output_router_logits": False, "router_aux_loss_coef": 0.0},
    moe=True,
)
"""Qwen3's attention and norms (the same state-dict adapter), every MLP a mixture of experts."""

EXPERT_KEYS = ("w1_EFD", "w3_EFD", "w2_EDF")
"""The stacked expert tensors of one layer (under ``moe.routed_experts.inner_experts.``)."""


def _shape(**fields) -> ModelShape:
    return ModelShape(family=QWEN3_MOE, rope_theta=QWEN3_MOE.rope_theta, rms_norm_eps=QWEN3_MOE.rms_norm_eps,
                      **fields)


def _with_experts(dense: ModelShape, **fields) -> ModelShape:
    """A dense Qwen3 flavor's attention and sizes, every MLP a mixture of experts."""
    return dataclasses.replace(dense, family=QWEN3_MOE, **fields)


FLAVORS: dict[str, ModelShape] = {
    # The tiny Qwen3 with 8 experts (top 2) per layer: learns the digit task on 2 CPU cores.
    "tiny-moe": _with_experts(qwen3.FLAVORS["tiny"], num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    # torchtitan's debugmodel_moe (not tied: torchtitan's MoE flavors are not).
    "debugmodel_moe": _with_experts(qwen3.FLAVORS["debugmodel"], num_experts=64, num_experts_per_tok=8,
                                    moe_intermediate_size=768, tie_word_embeddings=False),
    "30B-A3B": _shape(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, intermediate_size=6144,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
    ),
}


def stacked_expert_views(w13_EXD: torch.Tensor, w2_EDF: torch.Tensor) -> dict[str, torch.Tensor]:
    """The trainer's expert tensors as views into a fused-MoE layout: ``w13`` [experts, 2 * hidden, dim] with
    each expert's gate rows then its up rows (vLLM's w13_weight), ``w2`` [experts, dim, hidden]."""
    hidden = w13_EXD.shape[1] // 2
    return {"w1_EFD": w13_EXD[:, :hidden], "w3_EFD": w13_EXD[:, hidden:], "w2_EDF": w2_EDF}
