"""A torch.distributed store whose values are signed with a shared secret (the rollout server's sync messages).

The rollout server's store is reached only with ``serve.token``
(serving/sync_store.py); on top of that, the server and its trainer sign
every control message they put there (the tensor list, the plan, each sync header, each verdict, the
takeover notice) with HMAC-SHA256 under ``serve.token``, over the session id
(a fresh random nonce per connection), the key and the value. A value
written without the token, or copied from another key or another session
(a replay), fails the check: ``get`` raises ForgedMessage and logs it
(Rejections: the first at once, then one count per 30 s, never a line per
message), and a waiting reader keeps waiting for the genuine value, which overwrites
the forged one. The session's keys are named by ``session_namespace``
(HMAC of the session id under the token), so whoever learns the session id
without the token cannot compute where they are. The gloo/NCCL weight stream
itself is not signed: docs/design.md says what that trusts.
"""

import hashlib
import hmac
import threading
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from torchtitan_rl.weight_sync.store import ForgedMessage

_SEP = b"\n"


def session_namespace(secret: str, session: str) -> str:
    """Where a session's keys (and its gloo rendezvous) live in the store: HMAC-SHA256(secret, session)."""
    return hmac.new(secret.encode(), b"namespace" + _SEP + session.encode(), hashlib.sha256).hexdigest()


class Rejections:
    """Log lines for rejected messages that an attacker can send by the thousand: per (what, source), the
    first one at once, then, while more come, one line per ``every_s`` with their count."""

    def __init__(self, *, every_s: float = 30.0, log: Callable[[str], None] = print) -> None:
        self.every_s, self.log = every_s, log
        self._counts: dict[tuple[str, str], int] = {}
        """Rejections not yet logged, per (what, source) whose window is open."""
        self.totals: dict[str, int] = {}
        """Every rejection so far, per what (the rollout server's /health shows them)."""
        self._lock = threading.Lock()

    def __call__(self, what: str, source: str, first: str) -> None:
        """One more ``what`` (plural, e.g. "forged store messages") rejected from ``source``; ``first``: the
        line to log if none was logged for them in the last ``every_s``."""
        with self._lock:
            self.totals[what] = self.totals.get(what, 0) + 1
            key = (what, source)
            if key in self._counts:
                self._counts[key] += 1
                return
            self._counts[key] = 0
        self.log(first)
        self._later(key)

    def _later(self, key: tuple[str, str]) -> None:
        timer = threading.Timer(self.every_s, self._flush, args=(key,))
        timer.daemon = True
        timer.start()

    def _flush(self, key: tuple[str, str]) -> None:
        with self._lock:
            count = self._counts.pop(key)
            if count:
                self._counts[key] = 0  # still under attack: the window goes on
        if count:
            what, source = key
            self.log(f"torchtitan_rl: rejected {count} {what} in the last {self.every_s:g} s from {source}")
            self._later(key)


REJECTIONS = Rejections()
"""The process's rejection log (the rollout server's forged store messages and unauthorized requests)."""


class SignedStore(dist.Store):
    def __init__(self, inner: dist.Store, *, secret: str, session: str, rejections: Rejections = REJECTIONS) -> None:
        super().__init__()
        self.inner, self.session, self.rejections = inner, session, rejections
        self._key = secret.encode()
        self._seen: set[tuple[str, bytes]] = set()
        """Forged values already counted: a poller reads the same one many times."""

    def _mac(self, key: str, value: bytes) -> bytes:
        msg = _SEP.join([self.session.encode(), key.encode(), value])
        return hmac.new(self._key, msg, hashlib.sha256).hexdigest().encode()

    def set(self, key: str, value) -> None:
        value = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, self._mac(key, value) + _SEP + value)

    def get(self, key: str) -> bytes:
        raw = bytes(self.inner.get(key))
        mac, _, value = raw.partition(_SEP)
        if not hmac.compare_digest(mac, self._mac(key, value)):
            if (key, raw) not in self._seen:
                if len(self._seen) < 4096:  # bounded: past it, a value read twice is counted twice
                    self._seen.add((key, raw))
                self.rejections("forged store messages", f"session {self.session[:8]}",
                                f"torchtitan_rl: rejected a store message at {key!r} in session {self.session[:8]}: "
                                "bad signature (written without serve.token, or replayed); ignored")
            raise ForgedMessage(f"{key}: bad signature")
        return value

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)
