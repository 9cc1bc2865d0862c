"""The sync plan: which trainer tensor writes which generator memory.

Built once at startup from the trainer's tensor names/shapes and the
generator's destinations. Building it proves coverage: every element of every
tensor the generator computes with (parameters and buffers, fused storage
included) is written by exactly one trainer tensor, or is an engine-owned
constant with a known value; and every trainer tensor has a destination.
"""

from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor

from torchtitan_rl.models.destination import Destination


@dataclass(frozen=True)
class SourceSpec:
    """What the plan needs to know of one trainer tensor (no data)."""

    shape: torch.Size
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "SourceSpec":
        return cls(shape=t.shape, dtype=t.dtype)  # DTensor.shape is the global shape


@dataclass(frozen=True)
class Entry:
    source: str
    dest: torch.Tensor
    nbytes: int


@dataclass
class SyncPlan:
    entries: list[Entry]
    """One write per entry, in the trainer's state-dict order (same on every rank)."""
    aliases: dict[str, str]
    """Trainer keys whose destination another key already writes (tied weights)."""
    constants: dict[str, tuple[torch.Tensor, float]]
    """Engine-owned generator tensors and the value each must hold."""
    source_specs: dict[str, SourceSpec]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


def _view_key(t: torch.Tensor) -> tuple:
    if isinstance(t, DTensor):
        t = t.to_local()
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def source_aliases(sources: dict[str, torch.Tensor]) -> dict[str, str]:
    """Keys that name the same trainer tensor as an earlier key (tied weights).

    Every rank computes this from its own tensors, so all ranks agree on which
    keys move without exchanging anything.
    """
    aliases, seen = {}, {}
    for key, t in sources.items():
        vk = _view_key(t)
        if vk in seen:
            aliases[key] = seen[vk]
        else:
            seen[vk] = key
    return aliases


def build_plan(
    *,
    sources: dict[str, torch.Tensor],
    destinations: dict[str, Destination],
    generator_tensors: dict[str, torch.Tensor],
    constants: dict[str, tuple[torch.Tensor, float]],
) -> SyncPlan:
    """Match trainer tensors to generator views and prove the match complete.

    Raises ValueError naming the tensors when a trainer tensor has no
    destination or a wrong shape, or when generator memory would be left
    unwritten or written twice.
    """
    specs = {k: SourceSpec.of(t) for k, t in sources.items()}
    unknown = [k for k in sources if k not in destinations]
    if unknown:
        raise ValueError(f"weight_sync: trainer tensors with no generator destination: {unknown}")
    bad_shape = [
        f"{k} {tuple(s.shape)} vs {tuple(destinations[k].source_shape)}"
        for k, s in specs.items()
        if s.shape != destinations[k].source_shape
    ]
    if bad_shape:
        raise ValueError(f"weight_sync: shape mismatch trainer vs generator: {bad_shape}")
    if not all(s.dtype.is_floating_point for s in specs.values()):
        raise ValueError("weight_sync: trainer tensors must be floating point")

    aliases = source_aliases(sources)
    dest_aliases = source_aliases({k: destinations[k].view for k in sources})
    if aliases != dest_aliases:
        raise ValueError(
            "weight_sync: trainer and generator tie different tensors: "
            f"trainer {aliases}, generator {dest_aliases}"
        )
    entries = [
        Entry(k, destinations[k].view, destinations[k].view.numel() * destinations[k].view.element_size())
        for k in sources
        if k not in aliases
    ]

    _prove_coverage(
        [(e.source, e.dest) for e in entries]
        + [(name, t) for name, (t, _) in constants.items()],
        generator_tensors,
    )
    return SyncPlan(entries, aliases, constants, specs)


def _prove_coverage(
    writes: list[tuple[str, torch.Tensor]], generator_tensors: dict[str, torch.Tensor]
) -> None:
    """Every element of every generator tensor is written exactly once."""
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, view in writes:
        by_storage.setdefault(view.untyped_storage().data_ptr(), []).append((name, view))

    # Write counts per generator storage, on a CPU int8 copy of the layout
    # (same strides, no data read). Several tensors may share one storage:
    # tied weights, or LoRA adapters that are views of one flat buffer.
    counts: dict[int, torch.Tensor] = {}
    unwritten, twice = [], []
    for name, tensor in generator_tensors.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in counts:
            count = torch.zeros(tensor.untyped_storage().nbytes() // tensor.element_size(), dtype=torch.int8)
            for _, view in by_storage.pop(ptr, []):
                count.as_strided(view.shape, view.stride(), view.storage_offset()).add_(1)
            counts[ptr] = count
        region = counts[ptr].as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
        if bool((region == 0).any()):
            unwritten.append(name)
        if bool((region > 1).any()):
            twice.append(name)
    stray = [name for views in by_storage.values() for name, _ in views]
    problems = []
    if unwritten:
        problems.append(f"generator tensors left (partly) unwritten: {unwritten}")
    if twice:
        problems.append(f"generator tensors written twice: {twice}")
    if stray:
        problems.append(f"destinations outside the generator's tensors: {stray}")
    if problems:
        raise ValueError("weight_sync: " + "; ".join(problems))
