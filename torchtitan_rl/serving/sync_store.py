"""The sync sessions' store: in the server's memory, reached from outside only through ``POST /control/store``.

A TCPStore answers whoever reaches its port (list, overwrite, delete, and
park values without limit), so the rollout server opens none: its session
threads use an in-process ``dist.HashStore``, and the trainer's ranks reach
the same keys through the HTTP control plane, which needs ``serve.token``
(rollout/server_http.py: HttpStore). Here the store also checks what
comes through that door: only keys under a live session's prefix, and at
most ``max_bytes`` of values in all.
"""

import threading

import torch.distributed as dist


class StoreFull(ValueError):
    """A write through the control plane would take the store past its bound (serve.sync_store_mb)."""


class SyncStore:
    def __init__(self, *, max_bytes: int) -> None:
        self.store = dist.HashStore()
        """What the server's session threads (and their gloo/NCCL rendezvous) use directly."""
        self.max_bytes = max_bytes
        self._sizes: dict[str, int] = {}
        """Bytes of each key written through the control plane: what ``max_bytes`` bounds, and what ``drop``
        deletes."""
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            total = sum(self._sizes.values()) - self._sizes.get(key, 0) + len(value)
            if total > self.max_bytes:
                raise StoreFull(f"the sync store would hold {total} bytes, over serve.sync_store_mb "
                                f"({self.max_bytes / 2**20:g} MiB)")
            self._sizes[key] = len(value)
            self.store.set(key, value)

    def get(self, key: str) -> bytes | None:
        """The value of ``key``; None while it is not set (never waits)."""
        return bytes(self.store.get(key)) if self.store.check([key]) else None

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            self._sizes.setdefault(key, 8)  # a counter: a few bytes, but counted so drop() deletes it
            return self.store.add(key, amount)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._lock:
            self._sizes[key] = max(self._sizes.get(key, 0), len(desired))
            return bytes(self.store.compare_set(key, expected, desired))

    def drop(self, prefix: str) -> None:
        """Delete every key under ``prefix`` (a session that ended), whoever wrote it."""
        with self._lock:
            for key in [k for k in self._sizes if k.startswith(prefix)]:
                del self._sizes[key]
            for key in _written_by_server(self.store, prefix):
                self.store.delete_key(key)


def _written_by_server(store: dist.HashStore, prefix: str) -> list[str]:
    """Every key of ``store`` under ``prefix`` (the session threads' own writes included)."""
    return [k for k in store.list_keys() if k.startswith(prefix)]
