"""torch.distributed.checkpoint (DCP) checkpoints in step-N folders that prove themselves.

All ranks write their shards into ``step-N.tmp``. After a barrier every rank
fsyncs and checksums (CRC-32) a share of the files, and rank 0 writes
``manifest.json`` (every file's name, size and checksum) last, fsynced, then
renames the folder to ``step-N``. A checkpoint is complete only if its
manifest verifies: a crash mid-save, a truncated, deleted or overwritten file
or a half-pruned folder all fail :func:`verify`, and loading falls back to the
newest checkpoint that passes, saying why it skipped each newer one.
Pruning renames a folder to ``.trash`` before deleting it, so a killed prune
never leaves a ``step-N`` that looks complete. Assumes every rank sees the same
checkpoint folder (one host or a shared FS).
"""

import json
import os
import pickle
import re
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from torchtitan_rl.disk import free_space, refused, write_error
from torchtitan_rl.models.moe import ROUTING_BIAS

_STEP_DIR = re.compile(r"step-(\d+)")
MANIFEST = "manifest.json"
"""Written last in a checkpoint folder: {"step": N, "files": {name: {"size": bytes, "crc32": int}}}."""
_CHUNK = 8 << 20


def step_folders(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-N folder, verified or not, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def verify(path: Path) -> str | None:
    """None if every file the manifest lists is there with its size and checksum; else why not."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
        entries = [(name, int(e["size"]), int(e["crc32"])) for name, e in files.items()]
    except FileNotFoundError:
        return f"no {MANIFEST} (its save or its pruning was interrupted)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{MANIFEST} unreadable ({type(e).__name__})"
    if ".metadata" not in files:
        return f"{MANIFEST} lists no .metadata"
    for name, size, crc in entries:
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        actual = file.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size} (truncated or overwritten)"
        if _crc32(file) != crc:
            return f"{name} does not match its checksum (damaged bytes)"
    return None


def newest_verified(folder: Path, *, say: Callable[[str], None] = print) -> tuple[int, Path] | None:
    """(step, path) of the newest checkpoint that verifies; one line through ``say`` per newer one skipped."""
    for step, path in reversed(step_folders(folder)):
        why = verify(path)
        if why is None:
            return step, path
        say(f"torchtitan_rl: skipping checkpoint {path}: {why}")
    return None


def set_aside_newer(folder: Path, step: int) -> list[Path]:
    """Rename step-M folders with M > step (the damaged ones a resume from step-``step`` skipped) to step-M.damaged:
    kept for inspection, never loaded, and not counted by pruning (their steps are retrained)."""
    moved = []
    for m, path in step_folders(folder):
        if m > step:
            target = path.with_name(path.name + ".damaged")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(path, target)
            moved.append(target)
    return moved


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync_and_sum(path: Path) -> dict:
    with open(path, "rb") as f:
        os.fsync(f.fileno())
    return {"size": path.stat().st_size, "crc32": _crc32(path)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # The live parameters by their own names (fused wqkv, sharded DTensors):
    # model.state_dict() would split wqkv and gather it to every rank. MoE load balancing's routing biases
    # are buffers the optimizer's pre-hook trains: kept too (other buffers are derived, e.g. RoPE's caches).
    return {**{name: p.detach() for name, p in model.named_parameters()},
            **{name: b for name, b in model.named_buffers() if name.endswith(ROUTING_BIAS)}}


def save(
    folder: Path,
    *,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    extra: dict | None,
    trainer_step: int,
    keep_latest: int,
    files: dict[str, str] | None = None,
) -> Path:
    """Write step-N with its manifest (collective: every rank calls it) and prune older ones.

    ``files``: small text files (name -> content) rank 0 puts beside the shards, e.g. the run's config.
    A write the file system refuses (full, read-only) removes step-N.tmp and raises one ValueError naming
    the folder, its free space and the newest checkpoint that still verifies, on every rank.
    """
    final, tmp = folder / f"step-{step}", folder / f"step-{step}.tmp"
    rank, world = dist.get_rank(), dist.get_world_size()
    error = None
    if rank == 0:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for name, text in (files or {}).items():
                (tmp / name).write_text(text)
        except OSError as e:
            error = e
    _agree(error, folder=folder, step=step)  # also the barrier before every rank writes into tmp
    # Optimizer state exists only after the first step; asking torch for it
    # earlier would make it take a zero-lr step that advances Adam's step count.
    has_optimizer_state = bool(optimizer.state)
    rng = [None] * world
    dist.all_gather_object(rng, _rng_state())  # LoRA dropout draws from each rank's global RNG
    trainer_state = {
        "trainer_step": trainer_step,
        "has_optimizer_state": has_optimizer_state,
        # Plain python, pickled as one blob: DCP loads only keys it is given,
        # and the keys of `extra` are unknown before loading. Rank 0's copy is kept.
        "extra": extra,
        "rng": rng,
    }
    state = {"model": _model_state(model), "trainer": pickle.dumps(trainer_state)}
    if has_optimizer_state:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    mine = {}
    try:
        dcp.save(state, checkpoint_id=tmp)  # a rank's failed write fails every rank's call
        dist.barrier()  # every rank's shards are written
        # Each rank makes a share of the files durable and sums them: one read of the checkpoint, spread over ranks.
        names = sorted(p.name for p in tmp.iterdir())
        mine = {name: _fsync_and_sum(tmp / name) for name in names[rank::world]}
    except (OSError, RuntimeError, CheckpointException) as e:  # RuntimeError: torch's zip writer ("unexpected pos")
        error = e
    _agree(error, folder=folder, step=step)
    shares = [None] * world
    dist.all_gather_object(shares, mine)
    if rank == 0:
        try:
            manifest = {"step": step, "files": {k: v for share in shares for k, v in sorted(share.items())}}
            part = tmp / (MANIFEST + ".part")
            with open(part, "w") as f:
                json.dump(manifest, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(part, tmp / MANIFEST)
            _fsync_dir(tmp)
        except OSError as e:
            error = e
    _agree(error, folder=folder, step=step)
    if rank == 0:
        if final.exists():
            _discard(final)
        os.replace(tmp, final)
        _fsync_dir(folder)
        _prune(folder, keep_latest, newest=step)
    dist.barrier()
    return final


def _agree(error: BaseException | None, *, folder: Path, step: int) -> None:
    """Every rank learns whether any rank's part of the save failed. If one did, rank 0 removes step-N.tmp, and
    a rank whose own write the file system refused raises the one-line ValueError (disk.write_error), a rank
    with another error re-raises it (a bug keeps its traceback), and the others exit quietly (SystemExit)."""
    tmp = folder / f"step-{step}.tmp"
    why = refused(error, tmp) if error is not None else None
    mine = None if error is None else (why, free_space(tmp))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if all(e is None for e in everyone):
        return
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is None:
        raise SystemExit(2 if any(e is not None and e[0] for e in everyone) else 1)  # a peer says why
    if why is None:
        raise error
    found = newest_verified(folder, say=lambda _: None)
    kept = (f"{found[1].name} still verifies and --resume continues from it" if found is not None
            else "no earlier checkpoint of this run")
    raise write_error(folder, why, doing=f"saving step-{step}", free=mine[1],
                      kept=f"{tmp.name} removed, {kept}") from None


def _discard(path: Path) -> None:
    """Rename first (one atomic step: the folder stops being a step-N), then delete."""
    trash = path.with_name(path.name + ".trash")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash)


def _prune(folder: Path, keep_latest: int, *, newest: int) -> None:
    """Delete older checkpoints of this lineage: never one newer than the step just saved."""
    if keep_latest > 0:
        # Only step-N folders with a manifest count (no checksums: a save must stay cheap); those without one are
        # leftovers of an interrupted save or prune of this run and go too.
        older = [(s, p) for s, p in step_folders(folder) if s < newest]
        complete = [(s, p) for s, p in older if (p / MANIFEST).is_file()]
        for _, path in complete[: max(len(complete) - (keep_latest - 1), 0)] + [
            (s, p) for s, p in older if not (p / MANIFEST).is_file()
        ]:
            _discard(path)
    # No save is in flight now, so any .tmp or .trash left is from a crash.
    for path in [*folder.glob("step-*.tmp"), *folder.glob("step-*.trash")]:
        shutil.rmtree(path, ignore_errors=True)


def load(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Restore model and optimizer in place; returns the saved trainer state (step, extra)."""
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
    rng = trainer_state.get("rng")  # absent in checkpoints written before it was saved
    world = dist.get_world_size() if dist.is_initialized() else 1
    if rng is not None and len(rng) == world:  # on another world size the ranks keep their seeded RNGs
        _set_rng_state(rng[dist.get_rank() if dist.is_initialized() else 0])
    return trainer_state


def _rng_state() -> dict:
    """This rank's global torch RNG states: CPU, and the current CUDA device's when CUDA is in use."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_model(path: Path, *, model: torch.nn.Module) -> None:
    """Restore only the model's parameters, in place (an export needs no optimizer).

    ``model`` may be unsharded in a process without a process group: DCP
    reassembles whatever sharding the run saved with.
    """
    dcp.load({"model": _model_state(model)}, checkpoint_id=path)
