"""Messages through the job's store: wait for a key, collect every replica's answer."""

import time
from datetime import timedelta

import torch.distributed as dist


class ForgedMessage(RuntimeError):
    """A store value that failed its check (serving/signed_store.py: written without the token, or replayed):
    readers here skip it and wait for the genuine value."""


def store_value(store: dist.Store, key: str, timeout_s: float | None) -> bytes | None:
    """The value of ``key`` once set; None after ``timeout_s`` (None: wait forever).

    Waits in slices of at most 60 s: one store.wait with the whole timeout
    would hit the store's own default limit first. A forged value (a
    SignedStore's) is skipped: the genuine one, when it comes, overwrites it.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        wait = 60.0 if deadline is None else max(0.001, min(60.0, deadline - time.monotonic()))
        try:
            store.wait([key], timedelta(seconds=wait))
            return store.get(key)
        except (dist.DistStoreError, ForgedMessage) as e:
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if isinstance(e, ForgedMessage):
                time.sleep(0.05)


def get_text(store: dist.Store, key: str, timeout_s: float | None) -> str | None:
    value = store_value(store, key, timeout_s)
    return None if value is None else value.decode()


def who(replica: int, replicas: int, *, alone: str = "the generator") -> str:
    """How a message names a replica (``alone`` when it is the only one)."""
    return alone if replicas == 1 else f"generator replica {replica}"


def answers(store: dist.Store, key: str, replicas: int, timeout_s: float | None, *, what: str,
            hint: str = "") -> list[str]:
    """Each replica's value of ``key``/<replica>, in replica order, all within one ``timeout_s``.

    Raises RuntimeError naming the first replica that has not answered: the
    sender never goes on with fewer than all of them.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    out = []
    for r in range(replicas):
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        value = get_text(store, f"{key}/{r}", left)
        if value is None:
            raise RuntimeError(f"weight_sync: no {what} from {who(r, replicas)} within {timeout_s} s{hint}")
        out.append(value)
    return out
