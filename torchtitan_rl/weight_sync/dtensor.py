"""Local shards and whole tensors of (possibly) sharded trainer state."""

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard (the tensor itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def needs_gather(t: torch.Tensor) -> bool:
    """Decided from the layout, which every rank shares, so all ranks agree on
    whether to join the gather."""
    return isinstance(t, DTensor) and t.device_mesh.size() > 1 and not all(p.is_replicate() for p in t.placements)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor; gathers (collectively) only when shards live elsewhere."""
    return t.full_tensor() if needs_gather(t) else local(t)
