"""What the rollout server and its trainer client agree on: where to connect (and over TLS how) and the sync
session's store keys."""

import os
import socket
import ssl
from pathlib import Path

import psutil
import torch.distributed as dist

from torchtitan_rl.serving.signed_store import SignedStore, session_namespace

SESSION_PREFIX = "torchtitan_rl/serve"
"""Store prefix of a sync session's keys (+ /<session_namespace(token, session id)>)."""
ENDED = "ended"
"""Session key: the server's signed notice that a newer trainer replaced this session's."""


def connect_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def base_url(serve) -> str:
    """Where a trainer on this machine reaches the server of ``serve`` (the ServeConfig): https when the server
    has a certificate (serve.ssl_certfile) or the trainer a CA to check one against (serve.ssl_cafile)."""
    scheme = "https" if serve.ssl_certfile or serve.ssl_cafile else "http"
    return f"{scheme}://{connect_host(serve.host)}:{serve.port}"


def client_tls(serve) -> ssl.SSLContext | None:
    """The trainer's TLS context (None: plain HTTP): the server's certificate and host name are verified against
    serve.ssl_cafile, or the system's CAs when it is empty."""
    if not (serve.ssl_certfile or serve.ssl_cafile):
        return None
    try:
        return ssl.create_default_context(cafile=serve.ssl_cafile or None)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"serve.ssl_cafile: cannot load {serve.ssl_cafile} ({_why(e)})") from None


def check_server_tls(serve) -> None:
    """The server's certificate and key load (a one-line ValueError naming the field, before the engine starts)."""
    if not serve.ssl_certfile:
        return
    for field in ("ssl_certfile", "ssl_keyfile"):
        path = getattr(serve, field)
        if path and not Path(path).is_file():
            raise ValueError(f"serve.{field}: no such file: {path}")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(serve.ssl_certfile, serve.ssl_keyfile or None)
    except (OSError, ssl.SSLError) as e:
        key = f" with serve.ssl_keyfile {serve.ssl_keyfile}" if serve.ssl_keyfile else ""
        raise ValueError(f"serve.ssl_certfile: cannot load {serve.ssl_certfile}{key} ({_why(e)})") from None


def _why(e: Exception) -> str:
    return getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)


def bind_gloo(host: str) -> str | None:
    """Make every gloo device this process creates (vLLM's groups, the sync pair) listen on ``host``'s interface
    (GLOO_SOCKET_IFNAME; gloo otherwise binds the hostname's address, or whatever interface the variable names).
    Returns the interface; None for a wildcard host (every interface was asked for). A GLOO_SOCKET_IFNAME that
    names another interface is a ValueError: its listeners would be reachable where serve.host is not."""
    if host in ("0.0.0.0", "::", ""):
        return None
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        raise ValueError(f"serve.host: cannot resolve {host!r} ({e.strerror})") from None
    interface = next((name for name, addrs in psutil.net_if_addrs().items()
                      if any(a.address.split("%")[0] in addresses for a in addrs)), None)
    if interface is None:
        raise ValueError(f"serve.host: {host} is not an address of this machine's interfaces "
                         f"({', '.join(psutil.net_if_addrs())})")
    given = os.environ.get("GLOO_SOCKET_IFNAME")
    if given and given != interface:
        raise ValueError(f"serve.host: {host} is on interface {interface}, but GLOO_SOCKET_IFNAME={given} would put "
                         f"the server's gloo listeners on {given}; unset it (the server binds gloo to serve.host's "
                         f"interface) or set serve.host to an address of {given}")
    os.environ["GLOO_SOCKET_IFNAME"] = interface
    return interface


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
