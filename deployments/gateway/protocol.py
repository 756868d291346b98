"""The gateway's HTTP/1.1 protocol: uvicorn's httptools protocol with bounds a hostile client cannot pass.

uvicorn's httptools protocol reads a request head of any size for as long as the client cares to send it,
and keeps a connection that never sends a byte forever. Here (docs/gateway.md, "Bounds"):

- a request head larger than FADEN_GATEWAY_MAX_HEAD bytes is answered 431 and the connection closed;
- a request head not complete FADEN_GATEWAY_HEAD_TIMEOUT seconds after it began (or after the connection
  opened) is answered 408 and the connection closed: a head that never ends holds nothing for long;
- at most FADEN_GATEWAY_MAX_CONNECTIONS connections per process: a new one past the limit closes the
  connection that has waited longest without a request running (an idle or slow client), and is refused
  with 503 when every connection is busy with a request.

Idle kept-alive connections between requests are closed after FADEN_GATEWAY_KEEPALIVE seconds (uvicorn's
own timer, given on the command line by ``faden serve``). uvicorn imports this class by name (``--http``).

Two things for the gateway's request path (docs/gateway.md, "Against its peers"):

- the writes of one turn of the event loop go to the client in one (``OneWrite``): uvicorn writes an answer's
  head, each piece of its body and a stream's end apart, and each write is a system call (on loopback, the
  reader's wake-up too): a whole answer now costs one;
- the request's ``Client`` (in its scope) lets the application send what is written at once (``flush``: the
  answer's end goes before the gateway's own bookkeeping), and cancels the request when the client hangs up while
  the application has it ``armed``: no task per request watching for the disconnect.
"""
import asyncio
import logging
import resource

from django.conf import settings
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("deployments.gateway")


def _answer(status: bytes, text: str) -> bytes:
    body = text.encode()
    return (b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)


class Bounds:
    """The settings, read once per process (uvicorn imports this module before the application sets Django
    up, so not at import time)."""

    _read = None

    def __init__(self):
        self.max_head = settings.FADEN_GATEWAY_MAX_HEAD
        self.head_timeout = settings.FADEN_GATEWAY_HEAD_TIMEOUT
        self.max_connections = _room_for(settings.FADEN_GATEWAY_MAX_CONNECTIONS)
        self.too_large = _answer(b"431 Request Header Fields Too Large",
                                 f"The request's head is larger than the gateway's {self.max_head:,} bytes.\n")
        self.too_slow = _answer(b"408 Request Timeout",
                                f"The request's head did not arrive within {self.head_timeout:g} s.\n")
        self.too_many = _answer(b"503 Service Unavailable",
                                "The gateway is at its limit of connections; try again.\n")

    @classmethod
    def get(cls) -> "Bounds":
        if cls._read is None:
            cls._read = cls()
        return cls._read


SPARE_FILES = 256  # descriptors kept for the process's own files, its database and Redis, and its upstreams


def _room_for(connections: int) -> int:
    """Raise this process's open-file limit so that ``connections`` fit (up to the hard limit); when they
    cannot, lower the connection limit to what fits and say so."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 2 * connections + SPARE_FILES  # each client may hold an upstream connection too
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fitting = max(1, (soft - SPARE_FILES) // 2)
        log.warning("FADEN_GATEWAY_MAX_CONNECTIONS is %s but this process may open only %s files: %s connections "
                    "at most. Raise the open-file limit (ulimit -n) to allow more.", connections, soft, fitting)
        return fitting
    return connections


CLIENT = "faden.client"  # the request's Client, in its scope


class Client:
    """A request's client as the application sees it beside ASGI. While the application has it ``armed`` (its ``task``
    waiting on a copy), the client hanging up cancels that task; ``gone`` says the client left. ``flush`` sends what
    was written so far now rather than at the end of the event loop's turn."""

    __slots__ = ("task", "armed", "gone", "flush")

    def __init__(self, flush=None):
        self.task: asyncio.Task | None = None
        self.armed = False
        self.gone = False
        self.flush = flush or _nothing

    def hung_up(self) -> None:
        self.gone = True
        if self.armed and self.task is not None:
            self.task.cancel()


def _nothing() -> None:
    pass


class OneWrite:
    """The client's transport, its writes of one turn of the event loop sent in one (at the end of the turn, or
    before the connection closes). What else a transport does is the transport's own."""

    __slots__ = ("transport", "loop", "pending")

    def __init__(self, transport, loop):
        self.transport, self.loop = transport, loop
        self.pending: list[bytes] = []

    def write(self, data) -> None:
        if data:
            if not self.pending:
                self.loop.call_soon(self.flush)
            self.pending.append(data)

    def flush(self) -> None:
        pending = self.pending
        if pending:
            self.pending = []
            if not self.transport.is_closing():
                self.transport.write(pending[0] if len(pending) == 1 else b"".join(pending))

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def abort(self) -> None:
        self.pending = []
        self.transport.abort()

    def __getattr__(self, name):
        return getattr(self.transport, name)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bounds = Bounds.get()
        self.in_head = True  # reading a request's head (or waiting for the first byte of one)
        self.head_bytes = 0
        self.head_timer = None
        self.waiting_since = self.loop.time()  # when it last began to wait for a request

    # Connections: at most max_connections, the longest-waiting idle one gives way to a new one.
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.transport = OneWrite(transport, self.loop)
        if len(self.connections) > self.bounds.max_connections and not self._make_room():
            log.warning("Refused a connection: all %s connections are busy with requests.", self.bounds.max_connections)
            self._close_with(self.bounds.too_many)
            self.connections.discard(self)
            return
        self._arm_head_timer()

    def _make_room(self) -> bool:
        waiting = [c for c in self.connections
                   if c is not self and isinstance(c, BoundedHttpToolsProtocol) and c.waiting()]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.waiting_since)
        oldest._stop_head_timer()
        oldest.transport.close()
        self.connections.discard(oldest)  # now, not when the loop gets to connection_lost
        return True

    def waiting(self) -> bool:
        """Between requests or reading a head, no request of its own running: it may give way."""
        return (getattr(self, "in_head", False) and not self.transport.is_closing()
                and (self.cycle is None or self.cycle.response_complete))

    def connection_lost(self, exc) -> None:
        self._stop_head_timer()
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.scope[CLIENT].hung_up()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[CLIENT] = Client(self.transport.flush)

    # The head: bounded in bytes and in time. The timer runs only for a head that did not come whole in one read
    # (a request's usually does): no timer set and cancelled per request.
    def data_received(self, data: bytes) -> None:
        if self.in_head:
            self.head_bytes += len(data)
        super().data_received(data)
        if self.in_head and self.head_bytes and not self.transport.is_closing():
            if self.head_bytes > self.bounds.max_head:
                self._close_with(self.bounds.too_large)
            elif self.head_timer is None:
                self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self.in_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.in_head, self.head_bytes, self.waiting_since = True, 0, self.loop.time()

    def _arm_head_timer(self) -> None:
        self.head_timer = self.loop.call_later(self.bounds.head_timeout, self._head_too_slow)

    def _stop_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def _head_too_slow(self) -> None:
        self.head_timer = None
        if self.in_head and not self.transport.is_closing():
            self._close_with(self.bounds.too_slow if self.head_bytes else b"")

    def _close_with(self, answer: bytes) -> None:
        self._stop_head_timer()
        self.in_head = False
        if answer:
            self.transport.write(answer)
        self.transport.close()
