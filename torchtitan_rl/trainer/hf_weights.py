"""Load a local Hugging Face checkpoint (any family of models/families.py) into torchtitan's decoder.

Names and layouts are translated by the family's torchtitan state-dict
adapter; the fused ``wqkv`` is rebuilt from HF's q/k/v by the model's load hook.
"""

from pathlib import Path

import safetensors.torch
import torch.nn as nn

from torchtitan_rl.models.families import load_hf_state
from torchtitan_rl.models.shape import ModelShape


def load_hf_weights(model: nn.Module, *, shape: ModelShape, hf_dir: str | Path) -> None:
    """Copy the weights of ``hf_dir``/*.safetensors into an unsharded ``model`` (casting)."""
    files = sorted(Path(hf_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"model.hf_checkpoint: no *.safetensors files in {hf_dir}")
    hf_state = {}
    for file in files:
        try:
            hf_state.update(safetensors.torch.load_file(file))
        except safetensors.SafetensorError as e:
            raise ValueError(f"model.hf_checkpoint: {file}: not a whole safetensors file ({e})") from None
    load_hf_state(model, hf_state, shape, where=f"model.hf_checkpoint: {hf_dir}")
