"""generator.compile_cache_dir: where a compiled decoder is kept, so the next run of the same model shape starts
without compiling it again."""

import hashlib
import json
import os
from pathlib import Path

import torch

from torchtitan_rl.models.shape import ModelShape


def cached_model_folder(cache_dir: str, shape: ModelShape, *, device: torch.device) -> Path:
    """The engine's model folder (its config.json) at a path fixed by the model's shape and the engine's device
    under ``cache_dir`` (generator.compile_cache_dir), with vLLM's compile cache beside it (VLLM_CACHE_ROOT, unless
    set): vLLM keys its compile cache by the model's path among its config, so the same shape on the same device
    finds the decoder compiled by an earlier run. The device is in the path because inductor's code names its GPU
    (a colocated engine is vLLM's rank 0 on every GPU: rank 1 ran GPU 0's kernels, "CUDA driver error: invalid
    argument"). Written whole (a temporary file renamed): ranks and runs may write it at once."""
    root = Path(cache_dir).expanduser()
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm"))
    text = json.dumps(shape.to_hf_config(), indent=1)
    index = torch.cuda.current_device() if device.type == "cuda" and device.index is None else device.index
    tag = device.type if index is None else f"{device.type}{index}"
    folder = root / "models" / f"{hashlib.sha256(text.encode()).hexdigest()[:16]}-{tag}"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "config.json").is_file():
        part = folder / f"config.json.{os.getpid()}.part"
        part.write_text(text)
        os.replace(part, folder / "config.json")
    return folder
