"""Local shards and whole tensors of (possibly) sharded trainer state."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard


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


def _fsdp_sharded(t: torch.Tensor) -> bool:
    """Sharded on dim 0 over a 1-D mesh (FSDP's layout): gatherable by one flat all-gather."""
    if not needs_gather(t) or t.device_mesh.ndim != 1:
        return False
    placement = t.placements[0]
    return isinstance(placement, Shard) and placement.dim == 0


def _gathered(t: DTensor, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    """``t.full_tensor()`` of its shards cast to ``dtype`` first (the bytes that travel) and moved to ``device``
    (offloaded shards are gathered on the accelerator, not by the CPU's backend)."""
    shard = t.to_local()
    shard = shard.to(device=device or shard.device, dtype=dtype)
    return DTensor.from_local(shard, t.device_mesh, t.placements, shape=t.shape, stride=t.stride()).full_tensor()


def full_many(tensors: list[torch.Tensor], dtypes: list[torch.dtype] | None = None,
              device: torch.device | None = None) -> list[torch.Tensor]:
    """``full`` of each tensor, collectively on every rank; gathered ones come back in
    ``dtypes`` (the dtype they travel in), the others as they are (a caller's copy casts them).

    FSDP shards (dim 0 over one mesh) move in ONE all-gather per mesh and
    dtype: each rank packs its shards, cast first (half the bytes for fp32
    masters going to bf16), padded to ceil(rows / ranks) rows as DTensor
    splits them (a full_tensor() call per tensor costs host time: docs/design.md). Other layouts
    (tensor parallel, expert parallel's 2-D mesh) gather one by one, cast first as well. ``device``: where FSDP shards are packed and
    gathered (offloaded shards live on the CPU; the gather runs on the accelerator).
    """
    dtypes = dtypes or [t.dtype for t in tensors]
    out: list[torch.Tensor | None] = [None] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tensors):
        if _fsdp_sharded(t):
            groups.setdefault((id(t.device_mesh), dtypes[i]), []).append(i)
        elif needs_gather(t):
            out[i] = _gathered(t, dtypes[i], device)
        else:
            out[i] = local(t)
    for (_, dtype), idx in groups.items():
        mesh = tensors[idx[0]].device_mesh
        world = mesh.size()
        shards = [tensors[i].to_local() if device is None else tensors[i].to_local().to(device) for i in idx]
        shapes = [tensors[i].shape for i in idx]
        chunks = [-(-s[0] // world) * s[1:].numel() for s in shapes]  # padded elements per rank and tensor
        offsets = [0]
        for c in chunks:
            offsets.append(offsets[-1] + c)
        send = torch.empty(offsets[-1], dtype=dtype, device=device or shards[0].device)
        torch._foreach_copy_([send[o : o + s.numel()].view(s.shape) for o, s in zip(offsets, shards)], shards)
        recv = torch.empty(world, offsets[-1], dtype=dtype, device=send.device)
        dist.all_gather_into_tensor(recv.view(-1), send, group=mesh.get_group())
        dests, srcs = [], []
        for j, i in enumerate(idx):
            rows, row = shapes[j][0], shapes[j][1:].numel()
            per = -(-rows // world)
            whole = torch.empty(shapes[j], dtype=dtype, device=send.device)
            for r in range(world):
                n = max(0, min(per, rows - r * per))
                if n:
                    dests.append(whole.view(rows, row)[r * per : r * per + n])
                    srcs.append(recv[r, offsets[j] : offsets[j] + n * row].view(n, row))
            out[i] = whole
        torch._foreach_copy_(dests, srcs)
    return out
