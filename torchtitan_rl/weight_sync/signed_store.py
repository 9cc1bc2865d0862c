"""A torch.distributed store whose values are signed with a shared secret (the rollout server's sync messages).

The rollout server's store is reached only with ``serve.token``
(serving/sync_store.py); on top of that, the server and its trainer sign
every control message they put there (the tensor list, the plan, each sync header, each verdict, the
takeover notice) with HMAC-SHA256 under ``serve.token``, over the session id
(a fresh random nonce per connection), the key and the value. A value
written without the token, or copied from another key or another session
(a replay), fails the check: ``get`` raises ForgedMessage and logs it once,
and a waiting reader keeps waiting for the genuine value, which overwrites
the forged one. The session's keys are named by ``session_namespace``
(HMAC of the session id under the token), so whoever learns the session id
without the token cannot compute where they are. The gloo/NCCL weight stream
itself is not signed: docs/design.md says what that trusts.
"""

import hashlib
import hmac
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

_SEP = b"\n"


def session_namespace(secret: str, session: str) -> str:
    """Where a session's keys (and its gloo rendezvous) live in the store: HMAC-SHA256(secret, session)."""
    return hmac.new(secret.encode(), b"namespace" + _SEP + session.encode(), hashlib.sha256).hexdigest()


class ForgedMessage(RuntimeError):
    """A store value whose signature does not match (written without the token, or replayed)."""


class SignedStore(dist.Store):
    def __init__(self, inner: dist.Store, *, secret: str, session: str,
                 log: Callable[[str], None] = print) -> None:
        super().__init__()
        self.inner, self.session, self.log = inner, session, log
        self._key = secret.encode()
        self._seen: set[tuple[str, bytes]] = set()
        """Forged values already logged: a poller reads the same one many times."""

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
                self._seen.add((key, raw))
                self.log(f"torchtitan_rl: rejected a store message at {key!r} in session "
                         f"{self.session[:8]}: bad signature (written without serve.token, or replayed); ignored")
            raise ForgedMessage(f"{key}: bad signature")
        return value

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)
