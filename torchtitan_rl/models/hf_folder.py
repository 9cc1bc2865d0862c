"""A local Hugging Face folder checked file by file before transformers, vLLM or safetensors read it.

Those libraries report a cut-off config.json or a truncated shard as a long
traceback that names neither the file nor the setting; here each is one
ValueError naming the config field and the file.
"""

import json
from pathlib import Path

from safetensors import SafetensorError, safe_open


def check_hf_folder(folder: str, *, field: str) -> None:
    """ValueError("field: file: what is wrong") unless ``folder`` exists and every *.json parses and every
    *.safetensors file is whole (its header read and its size checked against it; the tensors are not read)."""
    path = Path(folder)
    if not path.is_dir():
        raise ValueError(f"{field}: folder not found: {folder}")
    for file in sorted(path.glob("*.json")):
        try:
            json.loads(file.read_bytes())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{field}: {file}: not valid JSON, cut off or damaged? ({e})") from None
    for file in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(file, framework="pt"):  # checks the header against the file's size
                pass
        except SafetensorError as e:
            raise ValueError(f"{field}: {file}: not a whole safetensors file, truncated or damaged? ({e})") from None


def check_weights(folder: str, *, field: str) -> None:
    """ValueError unless ``folder`` holds *.safetensors weights: the trainer's model.hf_checkpoint (checked before a
    run creates its folder) and the evaluator's --model."""
    if Path(folder).is_dir() and not any(Path(folder).glob("*.safetensors")):
        raise ValueError(f"{field}: no *.safetensors files in {folder} (a tokenizer-only or .bin folder?)")
