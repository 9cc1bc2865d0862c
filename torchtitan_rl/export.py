"""Export the policy as a Hugging Face folder that transformers and vLLM load as they are.

    python -m torchtitan_rl.export --run-dir outputs/X [--step N] --out DIR

The folder holds ``model.safetensors`` (HF names and layout), ``config.json``
under the family's real architecture (Qwen3ForCausalLM, LlamaForCausalLM),
``generation_config.json``, and the tokenizer files and chat template, all
taken from the run's own ``export_files/`` (``snapshot``, written when the run
started), so a moved or deleted ``model.hf_checkpoint`` changes nothing. Weights are written in the
run's ``model.dtype`` (bf16 by default): the weights the generator served
and the trainer computed with, cast from the fp32 masters. A LoRA run's
adapters are merged, ``W + alpha/r * B @ A`` in fp32, then cast.

At the end of a run, simple_grpo calls ``export_hf`` when ``job.export`` or
``job.export_dir`` is set; this command does the same from any saved checkpoint of a run.
"""

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from safetensors.torch import save_file

from torchtitan_rl.run.exits import one_line_errors
from torchtitan_rl.config import LoRAConfig, load_toml
from torchtitan_rl.config.validation import tokenizer_dir
from torchtitan_rl.disk import complete_or_absent, partial, refused, write_error
from torchtitan_rl.distributed.dtensor import full
from torchtitan_rl.run.parts import run_shape, run_task
from torchtitan_rl.models.families import shape_from_hf_config, to_hf
from torchtitan_rl.models.lora import apply_lora, merged_state
from torchtitan_rl.models.shape import ModelShape, build_titan_model, qkv_views, titan_config
from torchtitan_rl.run.folder import run_to_resume
from torchtitan_rl.trainer import checkpoint

TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
)
"""Files copied from model.hf_checkpoint: the tokenizer and its chat template."""


SNAPSHOT = "export_files"
"""Folder of a run, written at its start beside config.toml: what its export needs beside the weights
(config.json, generation_config.json, the tokenizer files and chat template), so that an export never
depends on model.hf_checkpoint or task.tokenizer still being where they were."""


def snapshot(run: Path, *, cfg, task, shape: ModelShape) -> Path:
    """Write ``run``/export_files (rank 0, at the start of a run; a resumed run keeps the one it has).

    config.json is model.hf_checkpoint's, else the flavor's shape with the task's special token ids; the
    tokenizer files come from task.tokenizer or model.hf_checkpoint, else the task's own tokenizer is saved
    as a Hugging Face tokenizer (the digits task's). One line when a run has no tokenizer to include."""
    folder = run / SNAPSHOT
    if folder.is_dir():
        return folder
    model_dir, tok_dir = cfg.model.hf_checkpoint, tokenizer_dir(cfg)
    with complete_or_absent(folder) as tmp:
        if model_dir is not None and (Path(model_dir) / "config.json").is_file():
            shutil.copy(Path(model_dir) / "config.json", tmp)
        else:
            ids = {"eos_token_id": task.eos_id, "pad_token_id": task.pad_id}
            (tmp / "config.json").write_text(json.dumps({**shape.to_hf_config(dtype=cfg.model.dtype), **ids}, indent=2))
        for source in dict.fromkeys(d for d in (tok_dir, model_dir) if d is not None):
            if (Path(source) / "generation_config.json").is_file():
                shutil.copy(Path(source) / "generation_config.json", tmp)
                break
        if tok_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tok_dir) / name).is_file():
                    shutil.copy(Path(tok_dir) / name, tmp)
        else:
            _save_task_tokenizer(task, tmp)
    if not has_tokenizer(folder):
        print(f"torchtitan_rl: {folder}: no tokenizer to keep for the export (grpo.task's tokenizer is a "
              f"{type(task.tokenizer).__name__}, not a tokenizers.Tokenizer or a transformers tokenizer)")
    return folder


def _save_task_tokenizer(task, folder: Path) -> None:
    """The task's own tokenizer as Hugging Face files that AutoTokenizer loads (tokenizer.json + its config), with
    the task's chat template."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    tokenizer = task.tokenizer
    if isinstance(tokenizer, Tokenizer):
        specials = {"eos_token": tokenizer.id_to_token(task.eos_id), "pad_token": tokenizer.id_to_token(task.pad_id)}
        for name, token in (("bos_token", "<bos>"), ("unk_token", "<unk>")):  # the digits task's, if it has them
            if tokenizer.token_to_id(token) is not None:
                specials[name] = token
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=task.chat_template, **specials)
    if isinstance(tokenizer, PreTrainedTokenizerBase):
        tokenizer.save_pretrained(folder)


def has_tokenizer(folder: Path | None) -> bool:
    return folder is not None and any((Path(folder) / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))


def check_target(out_dir: str | Path) -> Path:
    """The export folder, which must be new or empty (an export never mixes with other files)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"export: {out} exists and is not empty")
    return out


def export_hf(
    state: dict[str, torch.Tensor],
    *,
    shape: ModelShape,
    out_dir: str | Path,
    tokenizer_dir: str | Path | None = None,
    lora: LoRAConfig | None = None,
    dtype: str = "bfloat16",
    hf_checkpoint: str | Path | None = None,
    kept: Callable[[], str] = lambda: "the tensors given are unchanged",
) -> Path:
    """Write ``state`` (the trainer's tensors, e.g. ``Trainer.sync_state()``) as an HF folder.

    Collective when ``state`` holds sharded DTensors: every trainer rank
    calls it, tensors are gathered one at a time, rank 0 writes. ``kept``: where the weights still are when the
    file system refuses the export (asked then only: it may verify a checkpoint).
    """
    out = check_target(out_dir)
    if shape.load_balance_coeff:
        raise ValueError("export: the run's MoE layers have a routing bias (model.moe_load_balance_coeff > 0) "
                         "that HF Qwen3MoeForCausalLM has no place for; the export would be another model")
    if lora is not None and lora.rank:
        state = merged_state(state, lora)
    torch_dtype = getattr(torch, dtype)
    writes = dist.get_rank() == 0 if dist.is_initialized() else True
    tensors = {}
    for name, t in state.items():
        whole = full(t).detach()  # every rank joins each gather, in the state's order
        if not writes or name.endswith("rope.cache"):  # the RoPE cache is recomputed from config.json
            continue
        whole = whole.to("cpu", torch_dtype)
        if name.endswith("qkv_linear.wqkv.weight"):
            prefix = name[: -len("wqkv.weight")]
            for key, view in qkv_views(whole, shape).items():
                tensors[f"{prefix}{key}.weight"] = view.reshape(-1, shape.hidden_size)
        else:
            tensors[name] = whole
    if not writes:
        return out
    hf_state = {k: v.contiguous() for k, v in to_hf(tensors, shape).items()}
    expected = _expected_hf_shapes(shape)
    assert {k: tuple(v.shape) for k, v in hf_state.items()} == expected, "exported tensors differ from the HF model's"

    try:
        _write_folder(out, hf_state, shape=shape, tokenizer_dir=tokenizer_dir, hf_checkpoint=hf_checkpoint, dtype=dtype)
    except (OSError, SafetensorError) as e:
        why = refused(e, out)
        if why is None:
            raise
        tmp = partial(out)
        left = f"{tmp.name} could not be removed" if tmp.exists() else f"{tmp.name} removed"
        raise write_error(out, why, doing="exporting", kept=f"nothing written there ({left}); {kept()}") from None
    return out


def export_size(shape: ModelShape, *, dtype: str, files: Path) -> int:
    """Bytes an export takes on disk, at most: model.safetensors (tensors and header), the files it copies from
    ``files`` (export_files: config, tokenizer) and a generation_config.json, each in whole 4 KiB blocks, and
    64 KiB to spare (config.json gains its dtype)."""
    shapes = _expected_hf_shapes(shape)
    weights = sum(math.prod(s) for s in shapes.values()) * getattr(torch, dtype).itemsize
    header = 256 * len(shapes)  # per tensor its name, dtype, shape and offsets in JSON: ~100 bytes
    sizes = [weights + header, 4096] + [p.stat().st_size for p in Path(files).iterdir() if p.is_file()]
    return sum(-(-size // 4096) * 4096 for size in sizes) + (64 << 10)


def weights_left(run: Path, cfg) -> str:
    """Where a run's trained weights are when its end-of-run export failed, and the command that exports them."""
    found = checkpoint.newest_verified(run / cfg.trainer.checkpoint.folder, say=lambda _: None)
    if found is None:
        return "the trained weights are lost: the run saved no checkpoint (--trainer.checkpoint.enable keeps them)"
    step, path = found
    command = f"`python -m torchtitan_rl.export --run-dir {run} --step {step} --out DIR` exports it"
    if step == cfg.trainer.steps:
        return f"the trained weights are in {path}, which verifies: {command}"
    return (f"what steps {step}..{cfg.trainer.steps - 1} trained is lost; {path} verifies: {command}, and "
            "--resume trains them again")


def _write_folder(out: Path, hf_state: dict, *, shape: ModelShape, tokenizer_dir, hf_checkpoint, dtype: str) -> None:
    """The export's files, all or none (disk.complete_or_absent)."""
    with complete_or_absent(out) as tmp:
        save_file(hf_state, tmp / "model.safetensors", metadata={"format": "pt"})
        # The model's own config.json (model.hf_checkpoint), never the tokenizer folder's: task.tokenizer may
        # lend a random model another checkpoint's tokenizer.
        config = _hf_config(shape, hf_checkpoint, dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        source = Path(tokenizer_dir) if tokenizer_dir is not None else None
        if source is not None and (source / "generation_config.json").is_file():
            shutil.copy(source / "generation_config.json", tmp)
        else:
            ids = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if config.get(k) is not None}
            (tmp / "generation_config.json").write_text(json.dumps(ids, indent=2))
        for name in TOKENIZER_FILES:
            if source is not None and (source / name).is_file():
                shutil.copy(source / name, tmp)
        _readable_as_usual(tmp)
    if not has_tokenizer(out):
        where = f"none in {source}" if source else "the run had none"
        print(f"torchtitan_rl: export: {out} has no tokenizer ({where}):"
              " transformers and vLLM load its weights only with a tokenizer folder given beside it")


def _readable_as_usual(folder: Path) -> None:
    """Every file with the mode a new file gets under the umask (safetensors writes 0600), so that whoever may
    read the rest of the folder, a serving account say, may read the weights."""
    umask = os.umask(0)
    os.umask(umask)
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~umask)


def _hf_config(shape: ModelShape, checkpoint: str | Path | None, dtype: str) -> dict:
    """The checkpoint's own config.json (our shape was read from it) with the new dtype, else our shape's."""
    path = Path(checkpoint) / "config.json" if checkpoint is not None else None
    if path is None or not path.is_file():
        return shape.to_hf_config(dtype=dtype)
    config = json.loads(path.read_text())
    config.pop("dtype", None)  # transformers 5 writes dtype, 4.x torch_dtype; both read torch_dtype
    config["torch_dtype"] = dtype
    return config


def _expected_hf_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """HF tensor names and shapes of the model (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = titan_config(shape).build()
    return {k: tuple(v.shape) for k, v in to_hf(model.state_dict(), shape).items()}


# ------------------------------------------------------------- from a saved checkpoint


def export_checkpoint(run_dir: str | Path, *, out: str | Path, step: int | None = None) -> Path:
    """Export step ``step`` (default: the newest that verifies) of the run in ``run_dir`` (a run folder, or a
    job.output_dir: its ``latest`` run)."""

    check_target(out)
    run = run_to_resume(Path(run_dir))
    if run is None:
        raise ValueError(f"export: --run-dir {run_dir} has no config.toml and no latest run (not a run's output folder?)")
    cfg = load_toml(run / "config.toml")
    folder = run / cfg.trainer.checkpoint.folder
    if step is None:
        found = checkpoint.newest_verified(folder, say=lambda line: print(line, file=sys.stderr))
        if found is None:
            raise ValueError(f"export: no checkpoint that verifies in {folder}")
        path = found[1]
    else:
        path = folder / f"step-{step}"
        if not path.is_dir():
            have = [s for s, _ in checkpoint.step_folders(folder)]
            raise ValueError(f"export: --step {step}: no complete checkpoint step-{step} in {folder} (have {have})")
        if (why := checkpoint.verify(path)) is not None:
            raise ValueError(f"export: --step {step}: {path} is damaged: {why}")
    files = model_files = run / SNAPSHOT
    if files.is_dir():  # the run's own copy: model.hf_checkpoint and task.tokenizer may have moved since
        config = files / "config.json"
        shape = shape_from_hf_config(json.loads(config.read_text()), where=f"export: {config}")
    else:  # a run from before export_files: its sources must still be there
        files, model_files = tokenizer_dir(cfg), cfg.model.hf_checkpoint
        shape = run_shape(cfg, run_task(cfg))
    model = build_titan_model(shape, seed=cfg.job.seed)  # every parameter is then read from the checkpoint
    if cfg.model.lora.rank:
        apply_lora(model, cfg.model.lora)
    print(f"torchtitan_rl: exporting {path}", file=sys.stderr)
    checkpoint.load_model(path, model=model)
    return export_hf(
        dict(model.named_parameters()), shape=shape, out_dir=out, tokenizer_dir=files, hf_checkpoint=model_files,
        lora=cfg.model.lora, dtype=cfg.model.dtype,
        kept=lambda: f"{path} is untouched: the same command with another --out writes it",
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_rl.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True,
                        help="a run folder (config.toml + checkpoints), or a job.output_dir: its latest run")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the newest that verifies)")
    parser.add_argument("--out", required=True, help="folder to write; must not exist or be empty")
    args = parser.parse_args(argv)
    with one_line_errors():
        out = export_checkpoint(args.run_dir, out=args.out, step=args.step)
    print(f"torchtitan_rl: exported {args.run_dir} -> {out}")


if __name__ == "__main__":
    main()
