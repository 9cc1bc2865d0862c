"""What the rollout server and its trainer client agree on: where to connect and the sync session's store keys."""

import socket

import torch.distributed as dist

from torchtitan_rl.weight_sync.signed_store import SignedStore, session_namespace

SESSION_PREFIX = "torchtitan_rl/serve"
"""Store prefix of a sync session's keys (+ /<session_namespace(token, session id)>)."""
ENDED = "ended"
"""Session key: the server's signed notice that a newer trainer replaced this session's."""


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def listen(host: str, port: int, field: str) -> socket.socket:
    """A listening socket on ``host``:``port``; a busy port is a ValueError naming ``field`` (checked before the
    engine starts: minutes not wasted)."""
    try:
        return socket.create_server((host, port))
    except OSError as e:
        raise ValueError(f"{field}: cannot listen on {host}:{port} ({e.strerror or e}); is another server "
                         "running there?") from None


def session_prefix(session: str, *, secret: str, prefix: str = SESSION_PREFIX) -> str:
    """A session's keys' prefix: only a holder of serve.token can compute it from the session id."""
    return f"{prefix}/{session_namespace(secret, session)}"


def session_store(store: dist.Store, session: str, *, secret: str, prefix: str = SESSION_PREFIX) -> SignedStore:
    """A session's signed message store (both sides): keys under its prefix, signed for this session only."""
    return SignedStore(dist.PrefixStore(session_prefix(session, secret=secret, prefix=prefix), store), secret=secret,
                       session=session)


def pair_store(store: dist.Store, session: str, *, secret: str, prefix: str = SESSION_PREFIX) -> dist.PrefixStore:
    """Where the session's gloo/NCCL pair group meets (unsigned: c10d writes it), under the session's prefix."""
    return dist.PrefixStore(f"{session_prefix(session, secret=secret, prefix=prefix)}/pair", store)
