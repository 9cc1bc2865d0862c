"""The HTTP(S) side of the trainer's rollout-server client: JSON requests with the token or API key, one
deadline per thread across them, and the server's sync store as a torch.distributed Store.

``ServerClient.request`` turns every failure into one line naming the
server: ServerError (it answered with an error), ServerGone (nothing
answers, or the thread's deadline passed), ServerUntrusted (the TLS
handshake failed: a certificate not trusted under serve.ssl_cafile, or a
server without TLS; waiting would not help). ``ServerClient.deadline``
gives every request of the calling thread inside a block one end, so that a
frozen server ends a sync after weight_sync.peer_timeout_s, not after that
long per request. ``HttpStore`` is the server's sync store (one ``POST
/control/store`` per operation), which gloo's and NCCL's rendezvous and the
sync's messages use unchanged.
"""

import base64
import contextlib
import http.client
import json
import ssl
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta

import torch.distributed as dist

_SAY_EVERY_S = 5.0
"""How often a trainer waiting for its server says so."""
_HOLD_MARGIN_S = 0.25
"""A store wait asks the server to hold it this much less than the time left: its "not yet" arrives in time."""


class ServerError(RuntimeError):
    """The server answered a request with an error (its status, message and Retry-After, if any)."""

    def __init__(self, status: int, message: str, retry_after: str | None = None) -> None:
        super().__init__(f"rollout server: HTTP {status}: {message}")
        self.status, self.message, self.retry_after = status, message, retry_after

    def __reduce__(self):  # pickled to the other trainer ranks (broadcast_object_list)
        return ServerError, (self.status, self.message, self.retry_after)


class ServerGone(ValueError):
    """The server does not answer, or this trainer's session ended; one line naming the server."""


class ServerUntrusted(ServerGone):
    """The TLS handshake failed (a certificate this trainer does not trust, or a server without TLS): waiting
    would not help."""


class ServerClient:
    """JSON over HTTP(S) to one server (stdlib only); errors become ServerError with the server's message, or
    ServerGone when nothing answers. ``tls``: the context that verifies an https server's certificate."""

    def __init__(self, base_url: str, *, token: str = "", api_key: str = "", timeout_s: float = 1800.0,
                 tls: ssl.SSLContext | None = None) -> None:
        self.base_url, self.token, self.api_key, self.timeout_s = base_url.rstrip("/"), token, api_key, timeout_s
        self.tls = tls
        self._local = threading.local()
        """This thread's deadline, if inside ``deadline``: (monotonic end, seconds, what it bounds)."""

    @contextlib.contextmanager
    def deadline(self, timeout_s: float, what: str):
        """Every request this thread makes in the block (and every HttpStore wait, and every broadcast of the
        sync pair) ends by one deadline ``timeout_s`` from now; past it, a request raises ServerGone."""
        self._local.deadline = (time.monotonic() + timeout_s, timeout_s, what)
        try:
            yield
        finally:
            self._local.deadline = None

    def left(self) -> float | None:
        """Seconds left of this thread's deadline; None outside ``deadline``."""
        d = getattr(self._local, "deadline", None)
        return None if d is None else d[0] - time.monotonic()

    def request(self, method: str, path: str, body: dict | None = None, *, timeout_s: float | None = None) -> dict:
        """``timeout_s``: this request's limit (default: the client's; never past this thread's deadline)."""
        limit, left = timeout_s or self.timeout_s, self.left()
        if left is not None:
            if left <= 0:
                raise self._late(method, path)
            limit = min(limit, left)
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        key = self.token if path.startswith("/control/") else self.api_key
        if key:
            req.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(req, timeout=limit, context=self.tls) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raw = e.read()
            try:
                message = json.loads(raw)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = raw.decode(errors="replace")[:500]
            raise ServerError(e.code, message, e.headers.get("Retry-After")) from None
        except (urllib.error.URLError, ConnectionError, http.client.HTTPException, TimeoutError, ssl.SSLError) as e:
            reason = getattr(e, "reason", None) or e
            if isinstance(reason, ssl.SSLError):
                raise ServerUntrusted(self._tls_failure(reason)) from None
            if (left := self.left()) is not None and left <= 0:
                raise self._late(method, path) from None
            raise ServerGone(f"rollout server {self.base_url}: no answer to {method} {path} "
                             f"({type(reason).__name__}: {reason}); is it running?") from None

    def _late(self, method: str, path: str) -> ServerGone:
        _, seconds, what = self._local.deadline
        return ServerGone(f"rollout server {self.base_url}: no answer to {method} {path} within "
                          f"weight_sync.peer_timeout_s ({seconds:g} s) of {what}")

    def _tls_failure(self, e: ssl.SSLError) -> str:
        if isinstance(e, ssl.SSLCertVerificationError):
            return (f"rollout server {self.base_url}: its TLS certificate failed verification ({e.verify_message}); "
                    "set serve.ssl_cafile to the CA that signed it (or to the certificate itself), and give the "
                    "server a certificate that names this address")
        return (f"rollout server {self.base_url}: the TLS handshake failed ({e.reason or e}); does the server "
                "speak https (serve.ssl_certfile)?")

    def wait_ready(self, timeout_s: float) -> dict:
        """GET /health until the server answers (it may still be starting its engine); says so meanwhile."""
        started, said = time.monotonic(), None
        while True:
            try:
                # A short limit: a starting server's port is bound (and takes connections) before it answers.
                return self.request("GET", "/health", timeout_s=_SAY_EVERY_S)
            except ServerUntrusted:
                raise
            except ServerGone as e:
                waited = time.monotonic() - started
                if waited >= timeout_s:
                    raise ServerGone(f"{e} Waited {timeout_s:g} s (weight_sync.peer_timeout_s); start it with "
                                     "`python -m torchtitan_rl.serve`") from None
                if said is None or time.monotonic() - said >= _SAY_EVERY_S:
                    print(f"torchtitan_rl: waiting for the rollout server at {self.base_url} ({waited:.0f} s of "
                          f"{timeout_s:g} s, weight_sync.peer_timeout_s)", flush=True)
                    said = time.monotonic()
                time.sleep(0.5)


class HttpStore(dist.Store):
    """The server's sync store as a torch.distributed Store: each call one ``POST /control/store`` with
    serve.token (the server opens no store port: serving/sync_store.py says why). gloo's and NCCL's
    rendezvous and the sync's messages go through it unchanged."""

    def __init__(self, client: ServerClient, *, timeout_s: float) -> None:
        super().__init__()
        self.client, self.timeout_s = client, timeout_s

    def _op(self, op: str, **fields) -> dict:
        return self.client.request("POST", "/control/store", {"op": op, **fields})

    def set(self, key: str, value) -> None:
        self._op("set", key=key, value=_b64(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        return base64.b64decode(self._op("get", key=key)["value"])

    def check(self, keys: list[str]) -> bool:
        return self._op("check", keys=list(keys))["ready"]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Until every key is set; DistStoreError after ``timeout`` (default: weight_sync.peer_timeout_s), or
        ServerGone once the client's deadline passed (a ServerClient.deadline block)."""
        limit = self.timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        while True:
            left, bound = deadline - time.monotonic(), self.client.left()
            left = left if bound is None else min(left, bound)
            if self._op("wait", keys=list(keys), timeout_s=max(0.0, left - _HOLD_MARGIN_S))["ready"]:
                return
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"rollout server {self.client.base_url}: store keys {list(keys)} not set "
                                          f"within {limit:g} s")

    def add(self, key: str, amount: int) -> int:
        return self._op("add", key=key, amount=amount)["value"]

    def compare_set(self, key: str, expected, desired) -> bytes:
        reply = self._op("compare_set", key=key, expected=_b64(expected), desired=_b64(desired))
        return base64.b64decode(reply["value"])


def _b64(value) -> str:
    return base64.b64encode(value.encode() if isinstance(value, str) else bytes(value)).decode()
