"""Qwen3 shapes and how to build torchtitan's Qwen3 model from them.

One ``Qwen3Shape`` (Hugging Face field names) is the single description of a
model: the trainer builds torchtitan's ``Qwen3Model`` from it, the generator
writes it as the ``config.json`` vLLM reads, and a local HF checkpoint's
``config.json`` is read back into it.
"""

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

import torchtitan_rl.compat  # noqa: F401  (must run before torchtitan is imported)
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.qwen3 import Qwen3Model
from torchtitan.models.qwen3 import (  # private builders: pinned torchtitan==0.3.0
    _build_qwen3_layers,
    _EMBEDDING_INIT,
    _EMBEDDING_SKIP_INIT,
    _LINEAR_INIT,
    _qwen3_norm,
    _EPS as norm_eps,
)

TITAN_ARCH = "TorchTitanQwen3ForCausalLM"
"""Architecture name under which the generator's model is registered in vLLM."""


@dataclass(frozen=True, kw_only=True)
class Qwen3Shape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6

    def to_hf_config(self) -> dict:
        return {
            "architectures": [TITAN_ARCH],
            "model_type": "qwen3",
            "torch_dtype": "bfloat16",
            "hidden_act": "silu",
            "attention_bias": False,
            **dataclasses.asdict(self),
        }

    @classmethod
    def from_hf_config(cls, hf: dict) -> "Qwen3Shape":
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: hf[k] for k in fields if k in hf and hf[k] is not None}
        values.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
        if "rope_theta" not in values and isinstance(hf.get("rope_parameters"), dict):
            values["rope_theta"] = hf["rope_parameters"].get("rope_theta", 1e6)
        return cls(**values)


FLAVORS: dict[str, Qwen3Shape] = {
    # ~0.1M parameters: learns the embedded digit task on 2 CPU cores in minutes.
    "tiny": Qwen3Shape(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=192,
        vocab_size=0, max_position_embeddings=512, tie_word_embeddings=True,
    ),
    "debugmodel": Qwen3Shape(
        hidden_size=256, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072,
        vocab_size=2048, max_position_embeddings=4096, tie_word_embeddings=True,
    ),
    "0.6B": Qwen3Shape(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=3072,
        vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
    ),
    "1.7B": Qwen3Shape(
        hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, intermediate_size=6144,
        vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
    ),
    "4B": Qwen3Shape(
        hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=9728,
        vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=True,
    ),
    "8B": Qwen3Shape(
        hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=12288,
        vocab_size=151936, max_position_embeddings=40960, tie_word_embeddings=False,
    ),
}


def resolve_shape(
    *, flavor: str, hf_checkpoint: str | None, vocab_size: int, max_seq_len: int
) -> Qwen3Shape:
    """The model shape a run uses: the HF checkpoint's if given, else the flavor's."""
    if hf_checkpoint is not None:
        config_path = Path(hf_checkpoint) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"model.hf_checkpoint: no config.json in {hf_checkpoint}")
        return Qwen3Shape.from_hf_config(json.loads(config_path.read_text()))
    if flavor not in FLAVORS:
        raise ValueError(
            f"model.flavor: unknown flavor {flavor!r}; choose from {sorted(FLAVORS)}"
        )
    shape = FLAVORS[flavor]
    if vocab_size:
        shape = dataclasses.replace(shape, vocab_size=vocab_size)
    if shape.vocab_size <= 0:
        raise ValueError(f"model.vocab_size: flavor {flavor!r} needs a vocab size")
    # The RoPE cache (fp32, one per layer, in trainer and generator alike) only
    # needs the run's longest sequence: 40960 positions would be 1.2 GB at 0.6B.
    return dataclasses.replace(shape, max_position_embeddings=max_seq_len)


def titan_config(
    shape: Qwen3Shape, *, inner_attention=None
) -> Qwen3Model.Config:
    """torchtitan's Qwen3 config for a shape, with a chosen inner attention."""
    if shape.rms_norm_eps != norm_eps:
        raise ValueError(f"model: rms_norm_eps {shape.rms_norm_eps} unsupported (Qwen3 uses {norm_eps})")
    if inner_attention is None:
        # Causal SDPA: no masks needed for right-padded batches, and it runs on CPU.
        inner_attention = ScaledDotProductAttention.Config()
    rope = CosSinRoPE.Config(
        dim=shape.head_dim, max_seq_len=shape.max_position_embeddings, theta=shape.rope_theta
    )
    layers = _build_qwen3_layers(
        fuse_qkv=True,
        n_layers=shape.num_hidden_layers,
        dim=shape.hidden_size,
        n_heads=shape.num_attention_heads,
        n_kv_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        hidden_dim=shape.intermediate_size,
        attn_backend="flex",
        rope=rope,
    )
    layers = [
        dataclasses.replace(
            layer,
            attention=dataclasses.replace(layer.attention, inner_attention=inner_attention),
        )
        for layer in layers
    ]
    norm = _qwen3_norm(shape.hidden_size)
    tied = shape.tie_word_embeddings
    return Qwen3Model.Config(
        vocab_size=shape.vocab_size,
        dim=shape.hidden_size,
        norm=norm,
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=shape.vocab_size,
            embedding_dim=shape.hidden_size,
            param_init=_EMBEDDING_SKIP_INIT if tied else _EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(
            in_features=shape.hidden_size,
            out_features=shape.vocab_size,
            param_init=_LINEAR_INIT,
        ),
        layers=layers,
    )


def build_titan_model(
    shape: Qwen3Shape, *, seed: int, device: torch.device | str = "cpu", inner_attention=None
) -> Qwen3Model:
    """A torchtitan Qwen3 with seeded random weights (fp32) on ``device``."""
    config = titan_config(shape, inner_attention=inner_attention)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_states(buffer_device=torch.device(device))
    return model
