"""What the rollout server and its trainer client agree on: where to connect and the sync session's store keys."""

import torch.distributed as dist

from torchtitan_rl.config import JobConfig
from torchtitan_rl.weight_sync.signed_store import SignedStore

SESSION_PREFIX = "torchtitan_rl/serve"
"""Store prefix of a sync session's keys (+ /<session id>)."""
ENDED = "ended"
"""Session key: the server's signed notice that a newer trainer replaced this session's."""


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def sync_port(cfg: JobConfig) -> int:
    return cfg.serve.sync_port or cfg.serve.port + 1


def session_store(store: dist.Store, session: str, *, secret: str) -> SignedStore:
    """A session's signed message store (both sides): keys under its prefix, signed for this session only."""
    return SignedStore(dist.PrefixStore(f"{SESSION_PREFIX}/{session}", store), secret=secret, session=session)
