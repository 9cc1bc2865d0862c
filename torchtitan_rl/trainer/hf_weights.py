"""Load a local Hugging Face Qwen3 checkpoint into torchtitan's Qwen3.

Names and layouts are translated by torchtitan's own Qwen3StateDictAdapter;
the fused ``wqkv`` is rebuilt from HF's q/k/v by the model's load hook.
"""

from pathlib import Path

import safetensors.torch
import torch.nn as nn

from torchtitan_rl.models.qwen3 import Qwen3Shape, titan_config
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter


def load_hf_weights(model: nn.Module, *, shape: Qwen3Shape, hf_dir: str | Path) -> None:
    """Copy the weights of ``hf_dir``/*.safetensors into an unsharded ``model`` (casting)."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.hf_checkpoint: no *.safetensors files in {hf_dir}")
    hf_state = {}
    for file in files:
        hf_state.update(safetensors.torch.load_file(file))
    adapter = Qwen3StateDictAdapter(titan_config(shape), None)
    titan_state = adapter.from_hf(hf_state)
    if shape.tie_word_embeddings:
        # Tied checkpoints may still carry lm_head.weight; the embedding is the truth.
        titan_state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(titan_state, strict=False)
    if shape.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(
            f"model.hf_checkpoint: {hf_dir} does not match the model: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
