"""The gateway's client to the copies: keep-alive HTTP/1.1 connections on asyncio, parsed by httptools.

Why not httpx: measured under bench/gateway.py, httpx's pool spent 700-900 us of CPU on each forwarded
request (httpcore looks at every pooled connection's socket on every request, and without sniffio it
tries an import each time), several times what the rest of the gateway costs; this client spends a
few tens. It does only what the gateway needs:

- one request at a time per connection; idle connections kept per copy (``IDLE_PER_COPY``, closed
  after ``IDLE_SECONDS``) and reused, newest first;
- the request written in one piece (head and body: the body is already read);
- the answer's status and headers, then its body as it arrives (``Response.read``), chunk by chunk,
  reading from the copy paused while the client is slower than the copy;
- a copy behind mutual TLS (``tls``: the gateway's ``ssl.SSLContext``, its client certificate) is called over
  TLS on connections of its own: the handshake is paid once per connection, kept alive like the others;
- ``ConnectFailed`` when no connection could be made (refused, not within the connect timeout, or a TLS
  handshake that failed): the copy never saw the request; ``BrokeOff`` when the connection ended before the answer did; ``TimedOut``
  when the copy sent nothing for the read timeout (the connection is then closed).

A kept-alive connection the copy closed while it was idle is noticed by the event loop at once; if a
request still meets one (closed before a single byte of the answer came), it is sent once more on a new
connection, as browsers do: the copy had not begun to answer it.
"""
from __future__ import annotations

import asyncio
import collections
import ssl
import time

import httptools

IDLE_PER_COPY = 256  # connections kept open to one copy while unused
IDLE_SECONDS = 60.0  # an unused connection is closed after this long
HIGH_WATER = 256 * 1024  # bytes of an answer held before reading from the copy pauses


class UpstreamError(Exception):
    pass


class ConnectFailed(UpstreamError):
    """No connection: the copy did not see the request (safe to send it to another)."""


class BrokeOff(UpstreamError):
    """The connection ended before the answer was whole."""


class TimedOut(BrokeOff):
    """The copy sent nothing for the read timeout: busy, not necessarily broken."""


class Response:
    """A copy's answer: ``status`` and ``headers`` (as sent, less the hop-by-hop ones the gateway drops
    later), then ``read()`` until it returns b"" (the end)."""

    __slots__ = ("status", "headers", "connection")

    def __init__(self, connection: UpstreamConnection, status: int, headers: list[tuple[bytes, bytes]]):
        self.connection = connection
        self.status = status
        self.headers = headers

    async def read(self, timeout: float | None = None) -> bytes:
        return await self.connection.read(timeout)

    def close(self) -> None:
        """Done with it: a whole answer's connection goes back to the pool, any other is closed."""
        self.connection.release()


class UpstreamConnection(asyncio.Protocol):
    """One connection to a copy, one request at a time."""

    def __init__(self, pool: Pool, key: tuple[str, int, bool]):
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done: asyncio.Future | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.waiter: asyncio.Future | None = None
        self.complete = False
        self.keep_alive = False
        self.received = False  # any byte of the answer
        self.error: Exception | None = None
        self.paused = False
        self.length_known = False

    # -- asyncio ----------------------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(BrokeOff(f"sent an answer that is not HTTP ({exc})"))
            self.transport.close()

    def eof_received(self):
        return False  # close

    def connection_lost(self, exc) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.head_done is None and not self.chunks and self.waiter is None:
            return  # idle: nothing was asked of it
        if self.head_done is not None and self.head_done.done() and not self.complete and not self.length_known:
            self.complete = True  # an answer without a length ends when the connection does
            self._wake()
            return
        if not self.complete:
            words = f"closed the connection ({exc})" if exc else "closed the connection"
            self._fail(BrokeOff(words + (" before it answered" if not self.received else " in the middle of its answer")))

    # -- httptools ---------------------------------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in (b"content-length", b"transfer-encoding"):
            self.length_known = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.head_done is not None and not self.head_done.done():
            self.head_done.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # only known here: the parser forgets it after
        self._wake()

    # -- the gateway's side ------------------------------------------------------------------------------

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, error: Exception) -> None:
        self.error = error
        if self.head_done is not None and not self.head_done.done():
            self.head_done.set_exception(error)
        self._wake()

    async def send(self, request: bytes, timeout: float | None) -> Response:
        if self.closed:
            raise BrokeOff("closed the connection before it answered")
        loop = asyncio.get_running_loop()
        self.head_done = head_done = loop.create_future()
        self.transport.write(request)
        # A timer, not asyncio.wait_for: this runs on every request.
        timer = None if timeout is None else loop.call_later(timeout, _time_out, head_done,
                                                             f"did not answer within {timeout:g} s")
        try:
            status = await head_done
        except (TimedOut, asyncio.CancelledError):
            self.abort()  # the copy may still answer: this connection cannot carry another request
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return Response(self, status, self.headers)

    async def read(self, timeout: float | None) -> bytes:
        while True:
            if self.chunks:
                chunk = self.chunks.popleft()
                self.buffered -= len(chunk)
                if self.paused and self.buffered < HIGH_WATER // 2:
                    self.paused = False
                    self.transport.resume_reading()
                return chunk
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            loop = asyncio.get_running_loop()
            self.waiter = waiter = loop.create_future()
            timer = None if timeout is None else loop.call_later(timeout, _time_out, waiter,
                                                                 f"sent nothing more for {timeout:g} s")
            try:
                await waiter
            except (TimedOut, asyncio.CancelledError):
                self.abort()
                raise
            finally:
                self.waiter = None
                if timer is not None:
                    timer.cancel()

    def release(self) -> None:
        """Back to the pool when the answer was read whole and the copy keeps the connection; else closed."""
        if self.closed:
            return
        if self.complete and self.keep_alive and not self.chunks and self.error is None:
            self._reset()
            self.pool.give_back(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.transport is not None:
            self.transport.close()


class Pool:
    """Connections to the copies, by address and port."""

    def __init__(self, *, connect_timeout: float):
        self.connect_timeout = connect_timeout
        self.idle: dict[tuple[str, int, bool], list[UpstreamConnection]] = {}

    async def request(self, host: str, port: int, head: bytes, body: bytes, *, timeout: float | None,
                      tls: ssl.SSLContext | None = None) -> Response:
        """Send one request (``head`` ends with the blank line) and return the answer once its head came;
        over TLS with ``tls`` (the copy's certificate checked against ``host``)."""
        key = (host, port, tls is not None)
        request = head + body
        idle = self.idle.get(key)
        while idle:
            connection = idle.pop()
            if connection.closed:
                continue
            try:
                return await connection.send(request, timeout)
            except BrokeOff:
                if connection.received:
                    raise
                # closed by the copy while idle, before a byte of an answer: send it on a new connection
        connection = await self._connect(key, tls)
        return await connection.send(request, timeout)

    async def _connect(self, key: tuple[str, int, bool], tls: ssl.SSLContext | None) -> UpstreamConnection:
        loop = asyncio.get_running_loop()
        secure = {"ssl": tls, "server_hostname": key[0], "ssl_handshake_timeout": self.connect_timeout} if tls else {}
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: UpstreamConnection(self, key), key[0], key[1], **secure),
                self.connect_timeout)
        except TimeoutError:
            raise ConnectFailed(f"did not accept a connection within {self.connect_timeout:g} s") from None
        except ConnectionRefusedError:
            raise ConnectFailed("Connection refused") from None
        except ssl.SSLError as exc:
            raise ConnectFailed(f"TLS handshake failed: {exc.reason or exc}") from None
        except OSError as exc:
            raise ConnectFailed(exc.strerror or str(exc)) from None
        return connection

    def give_back(self, connection: UpstreamConnection) -> None:
        connections = self.idle.setdefault(connection.key, [])
        if len(connections) >= IDLE_PER_COPY:
            connection.abort()
            return
        connection.idle_since = time.monotonic()
        connections.append(connection)

    def forget(self, connection: UpstreamConnection) -> None:
        connections = self.idle.get(connection.key)
        if connections and connection in connections:
            connections.remove(connection)

    def sweep(self) -> None:
        """Close the connections unused for IDLE_SECONDS."""
        oldest = time.monotonic() - IDLE_SECONDS
        for connections in list(self.idle.values()):
            for connection in [c for c in connections if c.idle_since < oldest]:
                connection.abort()

    def close(self) -> None:
        for connections in list(self.idle.values()):
            for connection in list(connections):
                connection.abort()
        self.idle.clear()


def _time_out(future: asyncio.Future, words: str) -> None:
    if not future.done():
        future.set_exception(TimedOut(words))


def copy_auth(api_key: str | None) -> list[tuple[bytes, bytes]]:
    """The header that opens a copy with a key of its own (``deployments/copy_keys.py``): the gateway sends the
    copy's key, never the client's (the client's Authorization is not passed up)."""
    return [(b"Authorization", b"Bearer " + api_key.encode("ascii"))] if api_key else []


def request_start(method: str, path: str, host: str, port: int, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request line and headers, without the blank line that ends a head."""
    shown = f"[{host}]" if ":" in host else host
    lines = [f"{method} {path} HTTP/1.1\r\nHost: {shown}:{port}\r\n".encode("latin-1")]
    lines += [name + b": " + value + b"\r\n" for name, value in headers]
    return b"".join(lines)


def request_head(method: str, path: str, host: str, port: int, headers: list[tuple[bytes, bytes]], length: int | None) -> bytes:
    """The request line and headers, ending with the blank line."""
    start = request_start(method, path, host, port, headers)
    return start + (b"Content-Length: %d\r\n\r\n" % length if length is not None else b"\r\n")
