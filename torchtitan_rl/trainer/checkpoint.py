"""Atomic torch.distributed.checkpoint (DCP) checkpoints in step-N folders.

All ranks write their shards into ``step-N.tmp``; after a barrier rank 0
renames it to ``step-N``. A folder named ``step-N`` is therefore always
complete, and a crash mid-save leaves only a ``.tmp`` that loading ignores.
Assumes every rank sees the same checkpoint folder (one host or a shared FS).
"""

import os
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

_STEP_DIR = re.compile(r"step-(\d+)")


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete step-N folder, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and (path / ".metadata").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # The live parameters by their own names (fused wqkv, sharded DTensors):
    # model.state_dict() would split wqkv and gather it to every rank.
    return {name: p.detach() for name, p in model.named_parameters()}


def save(
    folder: Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    extra: dict | None,
    trainer_step: int,
    keep_latest: int,
) -> Path:
    """Write step-N atomically (collective: every rank calls it) and prune old ones."""
    final, tmp = folder / f"step-{step}", folder / f"step-{step}.tmp"
    is_rank0 = dist.get_rank() == 0
    if is_rank0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    # Optimizer state exists only after the first step; asking torch for it
    # earlier would make it take a zero-lr step that advances Adam's step count.
    has_optimizer_state = bool(optimizer.state)
    trainer_state = {
        "trainer_step": trainer_step,
        "lr_scheduler": scheduler.state_dict(),
        "has_optimizer_state": has_optimizer_state,
        # Plain python, pickled as one blob: DCP loads only keys it is given,
        # and the keys of `extra` are unknown before loading. Rank 0's copy is kept.
        "extra": extra,
    }
    state = {"model": _model_state(model), "trainer": pickle.dumps(trainer_state)}
    if has_optimizer_state:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.save(state, checkpoint_id=tmp)
    dist.barrier()  # every rank's shards are on disk before the folder counts as complete
    if is_rank0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _prune(folder, keep_latest)
    dist.barrier()
    return final


def _prune(folder: Path, keep_latest: int) -> None:
    if keep_latest > 0:
        for _, path in complete_checkpoints(folder)[:-keep_latest]:
            shutil.rmtree(path)
    # No save is in flight now, so any .tmp left is from a crashed save.
    for path in folder.glob("step-*.tmp"):
        shutil.rmtree(path, ignore_errors=True)


def load(
    path: Path,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict:
    """Restore model, optimizer and scheduler in place; returns the saved trainer state."""
    head = {"trainer": b""}
    dcp.load(head, checkpoint_id=path)
    trainer_state = pickle.loads(head["trainer"])
    state = {"model": _model_state(model)}
    if trainer_state["has_optimizer_state"]:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    dcp.load(state, checkpoint_id=path)  # in place into the live (sharded) tensors
    if trainer_state["has_optimizer_state"]:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
    else:
        optimizer.state.clear()  # saved before the first step: Adam starts fresh
    scheduler.load_state_dict(trainer_state["lr_scheduler"])
    return trainer_state


def load_model(path: Path, *, model: torch.nn.Module) -> None:
    """Restore only the model's parameters, in place (an export needs no optimizer).

    ``model`` may be unsharded in a process without a process group: DCP
    reassembles whatever sharding the run saved with.
    """
    dcp.load({"model": _model_state(model)}, checkpoint_id=path)
