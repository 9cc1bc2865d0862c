"""What a weight sync writes into: the contract of the Engine and of the server's EngineLoop."""

from typing import Protocol

import torch


class SyncTarget(Protocol):
    """A generator the sync writes in place: its model's tensors, and the gate around each write."""

    model: torch.nn.Module
    """vLLM's model (engine/vllm_model.py): ``sync_targets``, ``all_tensors``, ``engine_constants``."""

    @property
    def weight_version(self) -> int | None:
        """The version served now; None: nothing (before the first sync, or after a failed one)."""

    def begin_sync(self) -> None:
        """Stop generating (what runs ends on its weights) before the first byte is written."""

    def finish_sync(self, version: int | None) -> None:
        """Serve ``version`` (the one before, if nothing was written) and admit again."""

    def abort_sync(self) -> None:
        """A write failed half way: serve nothing until the next sync."""
