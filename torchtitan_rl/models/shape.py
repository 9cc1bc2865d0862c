"""One description of a model, and torchtitan's decoder built from it.

A ``ModelShape`` (Hugging Face field names plus its ``Family``) is the single
description of a model: the trainer builds torchtitan's decoder from it, the
generator writes it as the ``config.json`` vLLM reads, an export writes it
for transformers, and a local HF checkpoint's ``config.json`` is read back
into it (models/families.py). Every family is built from torchtitan's Qwen3
decoder blocks; a family only says what differs (models/qwen3.py,
models/llama.py; docs/design.md says why one decoder serves both).
"""

import dataclasses
import math
from dataclasses import dataclass

import torch

import torchtitan_rl.compat  # noqa: F401  (must run before torchtitan is imported)
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import (
    make_ffn_config, make_gqa_config, make_moe_config, make_routed_experts_config,
)
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3.model import Qwen3TransformerBlock
from torchtitan.models.qwen3 import (  # private init tables: pinned torchtitan==0.3.0
    _EMBEDDING_INIT,
    _EMBEDDING_SKIP_INIT,
    _LINEAR_INIT,
    _NORM_INIT,
    _moe_experts_init,
    _residual_output_init,
)

from torchtitan_rl.models.moe import Router


@dataclass(frozen=True, kw_only=True, eq=False)
class Family:
    """What one model family changes on the shared decoder (one instance per family: compared by identity)."""

    name: str
    """Our name of the family (a ModelShape's ``family``)."""
    hf_architecture: str
    """config.json ``architectures`` of its Hugging Face checkpoints, e.g. LlamaForCausalLM."""
    model_type: str
    """config.json ``model_type`` (picks the transformers config class)."""
    qk_norm: bool
    """RMSNorm of each query and key head before RoPE (Qwen3 has it, Llama not)."""
    rope_theta: float
    """RoPE base when a config.json does not give one."""
    rms_norm_eps: float
    """RMSNorm epsilon when a config.json does not give one."""
    hf_config_extra: dict
    """Further config.json fields transformers' class reads (all the decoder's fixed choices)."""
    state_dict_adapter: type
    """torchtitan StateDictAdapter class mapping HF tensor names to ours and back."""
    moe: bool = False
    """Every decoder layer's MLP is a mixture of experts (ModelShape's num_experts and its siblings)."""


MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")
"""ModelShape's MoE fields (HF Qwen3MoeConfig names)."""

LOAD_BALANCE_KEY = "torchtitan_rl_load_balance_coeff"
"""config.json key of ModelShape.load_balance_coeff (ours: the generator's model needs the routing bias too)."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    family: Family
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float
    rms_norm_eps: float
    rope_scaling: dict | None = None
    """Llama 3.1's RoPE frequency scaling: factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings (HF's rope_type "llama3"); None: plain RoPE."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0: a dense model (every layer a SwiGLU MLP of intermediate_size)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Hidden size of one expert's SwiGLU MLP."""
    norm_topk_prob: bool = True
    """The top-k gate weights are renormalised to sum to 1 (torchtitan's route_norm)."""
    load_balance_coeff: float = 0.0
    """torchtitan's auxiliary-loss-free load balancing step (model.moe_load_balance_coeff): > 0 gives each MoE
    layer a routing bias the trainer updates and the sync carries. Not an HF field (config.json keeps it
    under LOAD_BALANCE_KEY for the generator)."""

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    @property
    def qk_norm(self) -> bool:
        return self.family.qk_norm

    def to_hf_config(self, *, dtype: str = "bfloat16") -> dict:
        """config.json of this shape, under the family's real HF architecture."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "family"}
        del fields["load_balance_coeff"]
        if not self.moe:  # a dense config.json stays as it was
            for name in MOE_FIELDS:
                del fields[name]
        elif self.load_balance_coeff:
            fields[LOAD_BALANCE_KEY] = self.load_balance_coeff
        if self.rope_scaling is None:
            del fields["rope_scaling"]
        else:  # HF's legacy spelling: transformers 5 turns it into rope_parameters, 4.x reads it as is
            fields["rope_scaling"] = {"rope_type": "llama3", **self.rope_scaling}
        return {
            "architectures": [self.family.hf_architecture],
            "model_type": self.family.model_type,
            "torch_dtype": dtype,
            "hidden_act": "silu",
            "attention_bias": False,
            **self.family.hf_config_extra,
            # Top-level rope_theta: transformers 5 turns it into rope_parameters, 4.x reads it as is.
            **fields,
        }


def titan_config(shape: ModelShape, *, inner_attention=None) -> Qwen3Model.Config:
    """torchtitan's decoder config for a shape, with a chosen inner attention.

    torchtitan's Qwen3 blocks with the family's QK-norm choice and the
    shape's RMSNorm epsilon; initialisation as torchtitan's Qwen3 (so a
    seeded Qwen3 is the one torchtitan's own builder makes).
    """
    if inner_attention is None:
        # Causal SDPA: no masks needed for right-padded batches, and it runs on CPU.
        inner_attention = ScaledDotProductAttention.Config()
    eps = shape.rms_norm_eps

    def norm(dim: int) -> RMSNorm.Config:
        return RMSNorm.Config(normalized_shape=dim, eps=eps, param_init=_NORM_INIT)

    rope_cls = CosSinRoPE if shape.rope_scaling is None else ScaledCosSinRoPE
    rope = rope_cls.Config(
        dim=shape.head_dim, max_seq_len=shape.max_position_embeddings, theta=shape.rope_theta,
        **_llama_scaling(shape.rope_scaling),
    )
    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(shape.hidden_size),
            ffn_norm=norm(shape.hidden_size),
            attention=make_gqa_config(
                dim=shape.hidden_size,
                n_heads=shape.num_attention_heads,
                n_kv_heads=shape.num_key_value_heads,
                head_dim=shape.head_dim,
                wqkv_param_init=_LINEAR_INIT,
                # torchtitan's MoE flavors scale the residual output projection's init (Megatron's).
                wo_param_init=_residual_output_init(shape.num_hidden_layers) if shape.moe else _LINEAR_INIT,
                inner_attention=inner_attention,
                fuse_qkv=True,
                rope=rope,
                qk_norm=norm(shape.head_dim) if shape.qk_norm else None,
            ),
            **_mlp(shape),
        )
        for _ in range(shape.num_hidden_layers)
    ]
    tied = shape.tie_word_embeddings
    return Qwen3Model.Config(
        vocab_size=shape.vocab_size,
        dim=shape.hidden_size,
        norm=norm(shape.hidden_size),
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=shape.vocab_size,
            embedding_dim=shape.hidden_size,
            param_init=_EMBEDDING_SKIP_INIT if tied else _EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(in_features=shape.hidden_size, out_features=shape.vocab_size, param_init=_LINEAR_INIT),
        layers=layers,
    )


def _mlp(shape: ModelShape) -> dict:
    """A layer's MLP config: torchtitan's SwiGLU, or its Qwen3 MoE (as torchtitan's Qwen3 MoE flavors build it:
    softmax router, no shared expert) with our recording router."""
    if not shape.moe:
        return {"feed_forward": make_ffn_config(
            dim=shape.hidden_size, hidden_dim=shape.intermediate_size,
            w1_param_init=_LINEAR_INIT, w2w3_param_init=_LINEAR_INIT,
        )}
    router = Router.Config(
        num_experts=shape.num_experts,
        gate=Linear.Config(in_features=shape.hidden_size, out_features=shape.num_experts, bias=False,
                           param_init=_LINEAR_INIT),
        top_k=shape.num_experts_per_tok,
        score_func="softmax",
        route_norm=shape.norm_topk_prob,
    )
    return {"moe": make_moe_config(
        num_experts=shape.num_experts,
        router=router,
        routed_experts=make_routed_experts_config(
            dim=shape.hidden_size, hidden_dim=shape.moe_intermediate_size, num_experts=shape.num_experts,
            top_k=shape.num_experts_per_tok, param_init=_moe_experts_init(shape.num_hidden_layers),
            comm_backend="standard",
        ),
        load_balance_coeff=shape.load_balance_coeff or None,
    )}


class ScaledCosSinRoPE(CosSinRoPE):
    """torchtitan's cos/sin RoPE (HF's rotate-half convention) plus Llama 3.1's frequency scaling.

    torchtitan 0.3.0 implements "llama" scaling for its complex RoPE only;
    the frequencies here are HF's (``_compute_llama3_parameters``), so a
    Llama 3.1/3.2 checkpoint computes as in transformers.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(CosSinRoPE.Config):
        pass

    def _precompute_cache(self) -> torch.Tensor:
        cfg = self.config
        assert cfg.scaling == "llama", cfg.scaling
        inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, cfg.dim, 2)[: cfg.dim // 2].float() / cfg.dim))
        wavelen = 2 * math.pi / inv_freq
        old_len = cfg.original_max_position_embeddings
        # Long wavelengths are slowed by the factor, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > old_len / cfg.low_freq_factor, inv_freq / cfg.scaling_factor, inv_freq)
        smooth = (old_len / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
        smoothed = (1 - smooth) * scaled / cfg.scaling_factor + smooth * scaled
        medium = (wavelen >= old_len / cfg.high_freq_factor) & (wavelen <= old_len / cfg.low_freq_factor)
        inv_freq = torch.where(medium, smoothed, scaled)
        freqs = torch.outer(torch.arange(cfg.max_seq_len, dtype=inv_freq.dtype), inv_freq).float()
        angles = torch.cat([freqs, freqs], dim=-1)
        return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _llama_scaling(rope_scaling: dict | None) -> dict:
    """RoPE.Config fields for a shape's rope_scaling."""
    if rope_scaling is None:
        return {}
    return {
        "scaling": "llama",
        "scaling_factor": rope_scaling["factor"],
        "low_freq_factor": rope_scaling["low_freq_factor"],
        "high_freq_factor": rope_scaling["high_freq_factor"],
        "original_max_position_embeddings": rope_scaling["original_max_position_embeddings"],
    }


def build_titan_model(
    shape: ModelShape, *, seed: int, device: torch.device | str = "cpu", inner_attention=None
) -> Qwen3Model:
    """A torchtitan decoder with seeded random weights (fp32) on ``device``."""
    config = titan_config(shape, inner_attention=inner_attention)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device(device))
    return model


def qkv_views(wqkv: torch.Tensor, shape: ModelShape) -> dict[str, torch.Tensor]:
    """HF's q/k/v projections (torchtitan's checkpoint names wq/wk/wv) as views into the fused ``wqkv``.

    torchtitan fuses per KV group: rows are [q heads of group 0, k 0, v 0,
    q heads of group 1, ...], each ``head_dim`` rows. Each view is 3- or
    4-dimensional; ``reshape(-1, in_features)`` gives HF's 2-D weight.
    """
    n_kv = shape.num_key_value_heads
    per_kv = shape.num_attention_heads // n_kv
    w = wqkv.view(n_kv, per_kv + 2, shape.head_dim, -1)
    return {"wq": w[:, :per_kv], "wk": w[:, per_kv], "wv": w[:, per_kv + 1]}
