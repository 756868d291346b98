"""``probe serve|send``: can two machines reach each other on one network, and
how fast.

The sender connects, writes ``FADENPROBE 1\\n`` and then random bytes for the
given seconds, and closes its side; the receiver discards them and answers
one JSON line ``{"bytes": N}`` with what arrived, so the sender's rate counts
bytes that reached the other end rather than bytes left in its own buffers.
"""

import errno
import ipaddress
import json
import os
import select
import socket
import time

from .cli import arg, command, group, port_arg, seconds_arg
from .protocol import ADDRESS_IN_USE, BAD_INPUT, NOT_RETRYABLE, UNREACHABLE, AgentError

DEFAULT_PORT = 7471
MAGIC = b"FADENPROBE 1\n"
BLOCK = 1 << 20
EVERY = 0.5
CONNECT_TIMEOUT = 10.0
IO_TIMEOUT = 30.0
GRACE = 5.0


group("probe", help="bandwidth and reachability to another machine")


def _ip(text, flag):
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise AgentError(BAD_INPUT, "%s must be an IP address, got %r" % (flag, text))


def _mbps(nbytes, seconds):
    return round(nbytes * 8 / max(seconds, 1e-6) / 1e6, 1)


def _why(exc):
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


@command("probe", "serve", args=[
    arg("--bind", required=True, metavar="ADDR", help="address to listen on (0.0.0.0: all)"),
    arg("--port", type=port_arg, default=DEFAULT_PORT, help="TCP port (default 7471; 0: any)"),
    arg("--seconds", type=seconds_arg(0.1, 3600), default=10.0, help="how long the sender sends")])
def cmd_serve(args, out) -> int:
    """``probe serve --bind ADDR [--port 7471] [--seconds S]``: take one
    sender, discard its bytes, stop when it is done or after S+5 s.

    First a progress line ``{"event": "progress", "listening": true, "bind",
    "port"}`` (the port actually bound; ``--port 0`` takes a free one), then
    ``{"mbps", "bytes"}`` every 0.5 s.  Result: ``{"mbps", "bytes",
    "seconds", "sender", "complete"}``.  Nobody came: ``unreachable``; the
    port held by something else: ``address_in_use``.
    """
    bind = _ip(args.bind, "--bind")
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((bind, args.port))
            listener.listen(4)
        except OSError as exc:
            kind = ADDRESS_IN_USE if exc.errno == errno.EADDRINUSE else NOT_RETRYABLE
            raise AgentError(kind, "cannot listen on %s port %d: %s" % (bind, args.port, _why(exc)))
        port = listener.getsockname()[1]
        out.progress(listening=True, bind=bind, port=port)
        deadline = time.monotonic() + args.seconds + GRACE
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([listener], [], [], left)[0]:
                raise AgentError(UNREACHABLE, "no sender reached %s port %d within %g s"
                                 % (bind, port, args.seconds + GRACE))
            conn, peer = listener.accept()
            with conn:
                result = _receive(conn, peer, deadline, out)
            if result is not None:
                return out.result(**result)
    finally:
        listener.close()


def _receive(conn, peer, deadline, out):
    """Read one sender to EOF (or the deadline); None when it was not a probe."""
    conn.settimeout(min(IO_TIMEOUT, max(0.1, deadline - time.monotonic())))
    head = b""
    try:
        while len(head) < len(MAGIC):
            part = conn.recv(len(MAGIC) - len(head))
            if not part:
                break
            head += part
    except OSError:
        pass
    if head != MAGIC:
        out.log("ignored a connection from %s that is not a probe sender" % peer[0])
        return None
    buf = bytearray(BLOCK)
    received, started = 0, time.monotonic()
    last_at, last_bytes, complete = started, 0, False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        conn.settimeout(min(IO_TIMEOUT, left))
        try:
            n = conn.recv_into(buf)
        except OSError as exc:
            out.log("the sender %s went away: %s" % (peer[0], _why(exc)))
            break
        if not n:
            complete = True
            break
        received += n
        now = time.monotonic()
        if now - last_at >= EVERY:
            out.progress(mbps=_mbps(received - last_bytes, now - last_at), bytes=received)
            last_at, last_bytes = now, received
    seconds = time.monotonic() - started
    if complete:
        try:
            conn.settimeout(5.0)
            conn.sendall((json.dumps({"bytes": received}) + "\n").encode("ascii"))
        except OSError:
            pass
    return {"mbps": _mbps(received, seconds), "bytes": received, "seconds": round(seconds, 3),
            "sender": peer[0], "complete": complete}


@command("probe", "send", args=[
    arg("--to", required=True, metavar="ADDR", help="the receiving machine's address"),
    arg("--port", type=port_arg, default=DEFAULT_PORT, help="TCP port (default 7471)"),
    arg("--seconds", type=seconds_arg(0.1, 600), default=3.0, help="seconds to send (default 3)"),
    arg("--from", metavar="ADDR", help="local address to send from")])
def cmd_send(args, out) -> int:
    """``probe send --to ADDR [--port 7471] [--seconds 3] [--from ADDR]``:
    send random bytes to a ``probe serve`` for S seconds.

    Progress ``{"event": "progress", "mbps", "bytes"}`` every 0.5 s.
    Result: ``{"mbps", "bytes", "seconds", "sent"}`` (``bytes``: what the
    receiver counted, ``mbps``: megabits per second).  No answer, refused or
    cut: ``unreachable``.
    """
    to = _ip(args.to, "--to")
    source = (_ip(getattr(args, "from"), "--from"), 0) if getattr(args, "from") else None
    try:
        sock = socket.create_connection((to, args.port), timeout=CONNECT_TIMEOUT, source_address=source)
    except OSError as exc:
        raise AgentError(UNREACHABLE, "cannot reach %s port %d: %s" % (to, args.port, _why(exc)))
    with sock:
        sock.settimeout(IO_TIMEOUT)
        block = memoryview(os.urandom(BLOCK))
        sent = 0
        started = time.monotonic()
        end = started + args.seconds
        last_at, last_sent = started, 0
        try:
            sock.sendall(MAGIC)
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                sent += sock.send(block)
                if now - last_at >= EVERY:
                    out.progress(mbps=_mbps(sent - last_sent, now - last_at), bytes=sent)
                    last_at, last_sent = now, sent
            sock.shutdown(socket.SHUT_WR)
            reply = b""
            sock.settimeout(CONNECT_TIMEOUT + GRACE)
            while not reply.endswith(b"\n") and len(reply) < 1024:
                part = sock.recv(1024)
                if not part:
                    break
                reply += part
        except OSError as exc:
            raise AgentError(UNREACHABLE, "the connection to %s port %d broke after %d bytes: %s"
                             % (to, args.port, sent, _why(exc)))
        seconds = time.monotonic() - started
    try:
        received = int(json.loads(reply.decode("ascii"))["bytes"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise AgentError(UNREACHABLE, "%s port %d did not confirm what it received (is it a `probe serve`?)"
                         % (to, args.port))
    return out.result(mbps=_mbps(received, seconds), bytes=received, seconds=round(seconds, 3), sent=sent)
