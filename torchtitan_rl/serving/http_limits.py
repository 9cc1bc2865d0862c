"""What uvicorn does not bound: how long a client may take to send a request's headers, and its log.

uvicorn waits forever for headers that never end (or a connection that
never sends a byte): a slowloris holds a connection and its buffer for as
long as it likes. ``with_header_deadline`` returns uvicorn's HTTP protocol
with a deadline: a connection whose next request's headers are not complete
``timeout_s`` after its first byte (or after it opened) is closed. The body
has its own deadline in the handlers (server.py: ``_json``). uvicorn also logs
a warning per malformed request, which anyone can repeat by the thousand:
those go to the rejection log (one line, then a count per 30 s).
"""

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from torchtitan_rl.serving.signed_store import REJECTIONS


class _HeaderDeadline(HttpToolsProtocol):
    timeout_s: float = 30.0

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.logger = _Counted(self.logger, self.client[0] if self.client else "an unknown address")
        self._deadline = None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()  # the first bytes of the next request on this connection
        super().data_received(data)

    def connection_lost(self, exc) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.timeout_s, self._expire, self.cycle)

    def _expire(self, cycle) -> None:
        self._deadline = None
        if self.cycle is cycle and not self.transport.is_closing():  # no request's headers completed since
            source = self.client[0] if self.client else "an unknown address"
            REJECTIONS("connections too slow to send their headers", source,
                       f"torchtitan_rl serve: closed a connection from {source} that sent no complete request "
                       f"headers within {self.timeout_s:g} s (serve.read_timeout_s)")
            self.transport.close()


class _Counted:
    """uvicorn's logger for one connection, whose per-request 'Invalid HTTP request received.' is counted."""

    def __init__(self, logger, source: str) -> None:
        self._logger, self._source = logger, source

    def warning(self, msg, *args, **kwargs) -> None:
        if msg != "Invalid HTTP request received.":
            self._logger.warning(msg, *args, **kwargs)
            return
        REJECTIONS("invalid HTTP requests", self._source,
                   f"torchtitan_rl serve: rejected an invalid HTTP request from {self._source}")

    def __getattr__(self, name):
        return getattr(self._logger, name)


def with_header_deadline(timeout_s: float) -> type:
    """uvicorn's HTTP protocol class (``uvicorn.Config(http=...)``) with a ``timeout_s`` deadline for headers."""
    return type("HttpWithHeaderDeadline", (_HeaderDeadline,), {"timeout_s": timeout_s})
