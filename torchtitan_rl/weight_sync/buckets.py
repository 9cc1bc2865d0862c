"""The NCCL transport's flat buffers: which keys go in which bucket, and each key's view into the bytes."""

from dataclasses import dataclass

import torch

ALIGN = 16
"""Bytes; every tensor starts aligned in the flat buffers (vectorised copies, dtype views)."""
LEAD = 2
"""Buckets sent before the validation verdict: the generator's two receive buffers hold them unwritten."""
CHECKSUM_CHUNK = 1 << 25
"""Elements converted to float64 at a time by a checksum (256 MiB)."""


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def bucket_keys(keys: list[str], nbytes: dict[str, int], limit: int) -> list[list[str]]:
    """Consecutive key groups of at most ``limit`` wire bytes (one tensor may exceed it alone)."""
    buckets, current, size = [], [], 0
    for key in keys:
        if current and size + nbytes[key] > limit:
            buckets.append(current)
            current, size = [], 0
        current.append(key)
        size += nbytes[key]
    if current:
        buckets.append(current)
    return buckets


def views(buf: torch.Tensor, keys: list[str], layout: dict[str, tuple[torch.dtype, torch.Size]],
           nbytes: dict[str, int]) -> list[torch.Tensor]:
    """Each key's slice of a flat uint8 buffer, as its wire dtype and (trainer) shape."""
    out, offset = [], 0
    for k in keys:
        dtype, shape = layout[k]
        size = torch.Size(shape).numel() * dtype.itemsize
        out.append(buf[offset : offset + size].view(dtype).view(shape))
        offset += nbytes[k]
    return out


def checksum(t: torch.Tensor) -> torch.Tensor:
    """float64 [sum, sum |x|] of ``t`` in row-major order, in bounded chunks."""
    flat = t.reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=t.device)
    for chunk in flat.split(CHECKSUM_CHUNK):
        x = chunk.double()
        total += torch.stack([x.sum(), x.abs().sum()])
    return total


@dataclass
class Bucket:
    keys: list[str]
    flat: tuple[torch.Tensor, ...]
    """The bucket's bytes in send/receive buffer 0 and in buffer 1."""
    views: tuple[list[torch.Tensor], ...]
    """Each key's slice of ``flat[0]`` and of ``flat[1]``, as its wire dtype and layout shape."""
    dests: list[torch.Tensor] | None = None
    """Engine side: the plan's destination view per key, looked up on first use."""


class Buckets:
    """Two flat uint8 buffers and, per (key list, bucket size), the buckets with their views.

    Built on the first sync that moves those keys and reused after: building the views is host time on the
    critical path of both sides (docs/design.md, "Why the code looks this way").
    Growing the buffers drops the cached views (they would keep the old ones alive).
    """

    def __init__(self, device: torch.device, layout: dict[str, tuple[torch.dtype, torch.Size]],
                 key_bytes: dict[str, int]):
        self.device, self.layout, self.key_bytes = device, layout, key_bytes
        self.bufs: list[torch.Tensor] = []
        self._cache: dict[tuple[tuple[str, ...], int], list[Bucket]] = {}

    def get(self, keys: list[str], limit: int) -> list[Bucket]:
        cache_key = (tuple(keys), limit)
        if cache_key not in self._cache:
            groups = bucket_keys(keys, self.key_bytes, limit)
            sizes = [sum(self.key_bytes[k] for k in g) for g in groups]
            if max(sizes, default=0) > (self.bufs[0].numel() if self.bufs else 0):
                self._cache.clear()
                self.bufs = [torch.empty(max(sizes), dtype=torch.uint8, device=self.device) for _ in range(2)]
            self._cache[cache_key] = [
                Bucket(g, tuple(b[:n] for b in self.bufs),
                        tuple(views(b, g, self.layout, self.key_bytes) for b in self.bufs))
                for g, n in zip(groups, sizes)
            ]
        return self._cache[cache_key]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.bufs)
