"""The model families and flavors, and a run's shape from a flavor or an HF checkpoint.

A checkpoint's family is its config.json ``architectures``; a flavor's is
written in its shape. HF tensor names <-> ours go through the family's
torchtitan state-dict adapter (``from_hf`` / ``to_hf``).
"""

import dataclasses
import json
from pathlib import Path

import torch

from torchtitan_rl.models import llama, qwen3, qwen3_moe
from torchtitan_rl.models.shape import LOAD_BALANCE_KEY, MOE_FIELDS, Family, ModelShape, titan_config

FAMILIES: tuple[Family, ...] = (qwen3.QWEN3, llama.LLAMA, qwen3_moe.QWEN3_MOE)

FLAVORS: dict[str, ModelShape] = {**qwen3.FLAVORS, **llama.FLAVORS, **qwen3_moe.FLAVORS}
"""Named shapes for seeded random weights; a vocab_size of 0 takes the run's (the task tokenizer's)."""


LLAMA3_SCALING = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
"""The fields of HF's rope_type "llama3" (ModelShape.rope_scaling)."""


def family_by_model_type(model_type: str) -> Family:
    """The family of a config whose ``architectures`` is not a checkpoint's own (the generator's)."""
    found = [f for f in FAMILIES if f.model_type == model_type]
    assert found, f"no family with model_type {model_type!r}"
    return found[0]


def shape_from_hf_config(hf: dict, *, family: Family | None = None, where: str) -> ModelShape:
    """A config.json's shape. The family comes from ``architectures`` unless given.

    ``where`` names the config in errors, e.g. "model.hf_checkpoint: ckpt/config.json".
    Anything this decoder does not compute (RoPE scaling other than Llama
    3.1's, biases, sliding windows, another activation) is a ValueError
    rather than a silently different model.
    """
    if family is None:
        archs = hf.get("architectures") or []
        found = [f for f in FAMILIES if archs == [f.hf_architecture]]
        if not found:
            supported = ", ".join(f.hf_architecture for f in FAMILIES)
            raise ValueError(f"{where}: architecture {archs} is not supported (supported: {supported})")
        family = found[0]
    if family.moe and hf.get("num_experts") is None and hf.get("num_local_experts") is not None:
        hf = {**hf, "num_experts": hf["num_local_experts"]}  # transformers 5's to_dict spelling
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    # transformers 4.x: rope_scaling (None: plain); 5.x: rope_parameters with rope_type "default" or another.
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    unsupported = []
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "llama3":
        unsupported.append(f"RoPE scaling {scaling.get('rope_type', scaling.get('type'))!r} (only 'llama3' is)")
    if hf.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act {hf['hidden_act']!r}")
    unsupported += [f"{key} true" for key in ("attention_bias", "mlp_bias", "use_sliding_window") if hf.get(key)]
    if family.moe and hf.get("decoder_sparse_step", 1) != 1:
        unsupported.append(f"decoder_sparse_step {hf['decoder_sparse_step']} (every layer must be MoE)")
    if family.moe and hf.get("mlp_only_layers"):
        unsupported.append(f"mlp_only_layers {hf['mlp_only_layers']}")
    if unsupported:
        raise ValueError(f"{where}: not supported by this decoder: {', '.join(unsupported)}")
    optional = {"family", "head_dim", "rope_theta", "rms_norm_eps", "tie_word_embeddings", "rope_scaling",
                "load_balance_coeff", "norm_topk_prob", *(() if family.moe else MOE_FIELDS)}
    names = {f.name for f in dataclasses.fields(ModelShape)} - optional
    missing = sorted(n for n in names if hf.get(n) is None)
    if missing:
        raise ValueError(f"{where}: missing {missing}")
    lacking = [k for k in LLAMA3_SCALING if scaling is not None and scaling.get(k) is None]
    if lacking:
        raise ValueError(f"{where}: rope_scaling 'llama3' lacks {lacking}")
    return ModelShape(
        family=family,
        **{n: hf[n] for n in names},
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),  # transformers' default for both families
        head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or family.rope_theta),
        rms_norm_eps=float(hf.get("rms_norm_eps") or family.rms_norm_eps),
        rope_scaling=None if scaling is None else {k: scaling[k] for k in LLAMA3_SCALING},
        **({"norm_topk_prob": bool(hf.get("norm_topk_prob", True)),
            "load_balance_coeff": float(hf.get(LOAD_BALANCE_KEY, 0.0))} if family.moe else {}),
    )


def resolve_shape(
    *, flavor: str, hf_checkpoint: str | None, vocab_size: int, max_seq_len: int, load_balance_coeff: float = 0.0
) -> ModelShape:
    """The model shape a run uses: the HF checkpoint's if given, else the flavor's; an MoE shape takes
    ``load_balance_coeff`` (model.moe_load_balance_coeff)."""
    shape = _resolve_shape(flavor=flavor, hf_checkpoint=hf_checkpoint, vocab_size=vocab_size, max_seq_len=max_seq_len)
    if shape.moe:
        shape = dataclasses.replace(shape, load_balance_coeff=load_balance_coeff)
    elif load_balance_coeff:
        raise ValueError(f"model.moe_load_balance_coeff: {load_balance_coeff} needs an MoE model "
                         f"({shape.family.hf_architecture} has no experts); set it to 0")
    return shape


def _resolve_shape(*, flavor: str, hf_checkpoint: str | None, vocab_size: int, max_seq_len: int) -> ModelShape:
    if hf_checkpoint is not None:
        config_path = Path(hf_checkpoint) / "config.json"
        if not config_path.is_file():
            raise ValueError(f"model.hf_checkpoint: no config.json in {hf_checkpoint}")
        try:
            hf = json.loads(config_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model.hf_checkpoint: {config_path}: not valid JSON ({e})") from None
        return shape_from_hf_config(hf, where=f"model.hf_checkpoint: {config_path}")
    if flavor not in FLAVORS:
        raise ValueError(f"model.flavor: unknown flavor {flavor!r}; choose from {sorted(FLAVORS)}")
    shape = FLAVORS[flavor]
    if vocab_size:
        shape = dataclasses.replace(shape, vocab_size=vocab_size)
    if shape.vocab_size <= 0:
        raise ValueError(f"model.vocab_size: flavor {flavor!r} needs a vocab size")
    # The RoPE cache (fp32, one per layer, in trainer and generator alike) only
    # needs the run's longest sequence: 40960 positions would be 1.2 GB at 0.6B.
    return dataclasses.replace(shape, max_position_embeddings=max_seq_len)


def from_hf(hf_state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """HF tensors by our checkpoint-format names (wq/wk/wv; the model's load hook fuses them).

    Tied shapes leave out lm_head.weight: the embedding is the truth, and
    tied checkpoints may or may not carry a copy.
    """
    adapter = shape.family.state_dict_adapter(titan_config(shape), None)
    state = adapter.from_hf(dict(hf_state))
    if shape.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def load_hf_state(
    model: torch.nn.Module, hf_state: dict[str, torch.Tensor], shape: ModelShape, *, where: str,
    owned_elsewhere: str | None = None,
) -> None:
    """Load HF tensors into a torchtitan model; ValueError naming ``where`` unless they cover it exactly
    (a tied lm_head, and tensors whose name holds ``owned_elsewhere``, excepted)."""
    missing, unexpected = model.load_state_dict(from_hf(hf_state, shape), strict=False)
    missing = [
        k for k in missing
        if not (shape.tie_word_embeddings and k == "lm_head.weight") and not (owned_elsewhere and owned_elsewhere in k)
    ]
    if missing or unexpected:
        raise ValueError(f"{where} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")


def to_hf(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Our checkpoint-format tensors (wq/wk/wv) by HF names; tied shapes store only the embedding."""
    adapter = shape.family.state_dict_adapter(titan_config(shape), None)
    hf_state = adapter.to_hf(dict(state))
    if shape.tie_word_embeddings:
        hf_state.pop("lm_head.weight", None)
    return hf_state
