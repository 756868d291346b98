"""``blob serve start|stop|status|run`` (also ``image serve ...``): every
machine's blob server, from which the other machines of a cluster fetch.

A small daemon (``run`` is its foreground loop, ``daemon.Daemon`` its start
and stop) answering ``GET`` and ``HEAD`` on ``/blobs/<sha256>`` and, for
agents and servers that know the older name, ``/images/<sha256>``, with
``Range: bytes=a-b``, from the store: the finished blob, or the ``.part``
still arriving, of which it only sends verified bytes; a range beyond them
waits (up to 60 s without news) for the fetch to verify more, which is how a
machine forwards a file while receiving it.  Optional bearer token, read
from ``--token-file`` on every request (so a new token needs no restart).

Its files under the agent home are named ``imageserve.*`` (configuration:
bind, port, store, token_file; status: pid, port actually bound, or the
error that stopped it): agents already running on machines use that name.
"""

import contextlib
import errno
import hmac
import http.server
import ipaddress
import json
import os
import re
import signal
import socket
import socketserver
import sys
import threading
import time
import urllib.parse

from . import get_version
from .blobspec import read_spec
from .blobstore import adopt_old_images, available
from .cli import STORE, arg, command, group, port_arg
from .daemon import Daemon
from .files import Layout, store_dir
from .install import Launch
from .protocol import ADDRESS_IN_USE, BAD_INPUT, NOT_RETRYABLE, RETRYABLE, AgentError

DEFAULT_PORT = 7470
WAIT_FOR_BYTES = 60.0
POLL = 0.02
PATH_RE = re.compile(r"^/(blobs|images)/([0-9a-f]{64})$")
RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$")

group("blob", "serve", help="the blob server daemon")
group("image", "serve", help="the blob server daemon (its older name)")


def server_daemon(home=None) -> Daemon:
    daemon = Daemon("imageserve", "the blob server", home)
    daemon.token_path = os.path.join(daemon.home, "imageserve.token")
    return daemon


def parse_range(header, size):
    """``(start, end)`` inclusive, None to send it all, or ``"unsatisfiable"``."""
    m = RANGE_RE.match(header or "")
    if not m or (not m.group(1) and not m.group(2)):
        return None                      # absent, malformed or several ranges: the whole file
    if not m.group(1):
        n = int(m.group(2))
        return (max(0, size - n), size - 1) if n else "unsatisfiable"
    start = int(m.group(1))
    end = int(m.group(2)) if m.group(2) else size - 1
    if m.group(2) and end < start:
        return None                      # invalid: ignored, as RFC 9110 says
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size - 1)


# ------------------------------------------------------------------ the HTTP side


class Handler(http.server.BaseHTTPRequestHandler):
    server_version = "fadenstack-blobserve/" + get_version()
    protocol_version = "HTTP/1.1"
    timeout = 120

    def do_GET(self):
        self._serve(body=True)

    def do_HEAD(self):
        self._serve(body=False)

    def log_message(self, fmt, *args):
        self.server.log("%s %s" % (self.address_string(), fmt % args))

    def _plain(self, status, text, headers=()):
        data = (text + "\n").encode("utf-8")
        self.send_response(status)
        for key, value in headers:
            self.send_header(key, value)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        if self.command != "HEAD":
            self.wfile.write(data)

    def _authorized(self) -> bool:
        path = self.server.token_file
        if not path:
            return True
        try:
            with open(path, "r", encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError as exc:
            self.server.log("cannot read the token file %s: %s" % (path, exc))
            return False
        got = (self.headers.get("Authorization") or "").encode("utf-8", "replace")
        return bool(token) and hmac.compare_digest(got, ("Bearer " + token).encode("utf-8"))

    def _serve(self, body: bool) -> None:
        m = PATH_RE.match(urllib.parse.urlsplit(self.path).path)
        if not m:
            return self._plain(404, "Not found: files are at /blobs/<sha256>")
        if not self._authorized():
            return self._plain(401, "A valid bearer token is needed", [("WWW-Authenticate", "Bearer")])
        digest = m.group(2)
        for _ in range(2):
            held = available(self.server.store, digest)
            if not held:
                return self._plain(404, "File %s is not held here" % digest)
            path, size, verified, complete = held
            try:
                fh = open(path, "rb")
                break
            except FileNotFoundError:       # renamed .part -> finished just now: look again
                continue
        else:
            return self._plain(404, "File %s is not held here" % digest)
        with fh:
            rng = parse_range(self.headers.get("Range"), size)
            if rng == "unsatisfiable":
                return self._plain(416, "The file has %d bytes" % size, [("Content-Range", "bytes */%d" % size)])
            start, end = rng or (0, size - 1)
            self.send_response(206 if rng else 200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(end - start + 1))
            if rng:
                self.send_header("Content-Range", "bytes %d-%d/%d" % (start, end, size))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("ETag", '"%s"' % digest)
            self.send_header("X-Faden-Verified-Bytes", str(verified))
            self.send_header("X-Faden-Complete", "1" if complete else "0")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            if body:
                self._send_body(fh, digest, size, start, end + 1, verified)

    def _send_body(self, fh, digest, size, pos, stop, ready) -> None:
        started = last_news = time.monotonic()
        first = pos
        while pos < stop:
            if pos < ready:
                try:
                    pos += self.connection.sendfile(fh, pos, min(ready, stop) - pos)
                except OSError as exc:
                    self.server.log("%s: sending %s stopped at byte %d: %s"
                                    % (self.address_string(), digest[:12], pos, exc))
                    return
                last_news = time.monotonic()
                continue
            if time.monotonic() - last_news > WAIT_FOR_BYTES:
                self.server.log("%s: no new verified bytes of %s for %d s at byte %d; closing"
                                % (self.address_string(), digest[:12], WAIT_FOR_BYTES, pos))
                return
            time.sleep(POLL)
            held = available(self.server.store, digest)
            if held and held[1] == size:
                ready = held[2]
        self.server.log("%s: sent bytes %d-%d of %s in %.2f s" % (
            self.address_string(), first, stop - 1, digest[:12], time.monotonic() - started))


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, bind, port, store, token_file, on_tick=None):
        self.address_family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self.store, self.token_file = store, token_file
        self.on_tick, self.last_tick = on_tick, time.monotonic()
        self._log_lock = threading.Lock()
        super().__init__((bind, port), Handler)

    def service_actions(self):
        # serve_forever calls this between requests: once a minute, the daemon's chores.
        if self.on_tick is not None and time.monotonic() - self.last_tick >= 60:
            self.last_tick = time.monotonic()
            self.on_tick()

    def server_bind(self):
        # HTTPServer.server_bind looks the address up in DNS (getfqdn); on a machine whose
        # resolver is unreachable that alone takes seconds. The name is never used here.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def log(self, message):
        with self._log_lock:
            sys.stderr.write("%s %s\n" % (time.strftime("%Y-%m-%dT%H:%M:%S"), message))
            sys.stderr.flush()


# ------------------------------------------------------------------ commands


def _urls(bind, port) -> dict:
    host = "[%s]" % bind if ":" in bind else bind
    base = "http://%s:%d" % (host, port)
    return {"url": base + "/images/", "blobs_url": base + "/blobs/"}


def _token_file(path):
    """The absolute path of a readable, non-empty token file, or None; bad_input otherwise."""
    if not path:
        return None
    path = os.path.abspath(path)
    try:
        with open(path, "r", encoding="utf-8") as fh:
            ok = bool(fh.read().strip())
    except (OSError, UnicodeDecodeError) as exc:
        raise AgentError(BAD_INPUT, "cannot read --token-file %s: %s" % (path, exc))
    if not ok:
        raise AgentError(BAD_INPUT, "--token-file %s is empty" % path)
    return path


def _token_from_stdin(server) -> str:
    """``--token-stdin``: ``{"token": "..."}`` on stdin, written 0600 beside the server's other files (the
    agent's home, which only root writes) and required from then on; never on a command line."""
    try:
        token = json.loads(read_spec(noun="token").decode("utf-8")).get("token")
    except (UnicodeDecodeError, ValueError, AttributeError):
        token = None
    if not isinstance(token, str) or not TOKEN_RE.match(token):
        raise AgentError(BAD_INPUT, 'send {"token": "..."} on stdin: 16 to 256 letters, digits, - and _')
    path = server.token_path
    temporary = path + ".new"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    os.replace(temporary, path)
    return path


TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{16,256}$")

START_ARGS = [
    arg("--bind", required=True, metavar="ADDR", help="address to listen on (0.0.0.0: all)"),
    arg("--port", type=port_arg, default=DEFAULT_PORT, help="TCP port (default 7470; 0: any)"),
    STORE,
    arg("--token-file", metavar="PATH", help="require this bearer token (read per request)"),
    arg("--token-stdin", action="store_true",
        help='require the bearer token sent on stdin as {"token": "..."} (kept 0600 in the agent\'s home)'),
]


@command("image", "serve", "start", args=START_ARGS)
@command("blob", "serve", "start", args=START_ARGS)
def cmd_start(args, out) -> int:
    """``blob serve start --bind ADDR [--port 7470] [--store PATH] [--token-file PATH | --token-stdin]``
    (also ``image serve start``): start the blob server.

    Idempotent: the same server already running is left alone; another
    configuration or agent version restarts it.  ``--port 0`` takes a free
    port.  A port held by something else: ``address_in_use``.
    Result: ``{"running": true, "pid", "bind", "port", "url", "blobs_url",
    "store", "restarted"}`` (``url`` ends in ``/images/``, ``blobs_url`` in
    ``/blobs/``: append a digest).
    """
    try:
        ipaddress.ip_address(args.bind)
    except ValueError:
        raise AgentError(BAD_INPUT, "--bind must be an IP address of this machine (or 0.0.0.0), got %r"
                         % args.bind)
    server = server_daemon()
    if args.token_stdin and args.token_file:
        raise AgentError(BAD_INPUT, "give --token-file or --token-stdin, not both")
    if args.token_stdin:
        Layout(server.home).ensure_home()
    config = {"bind": args.bind, "port": args.port, "store": store_dir(args.store),
              "token_file": _token_from_stdin(server) if args.token_stdin else _token_file(args.token_file)}
    launch = Launch(server.home)
    with server.control():
        changed = server.write_config(config)
        pid, restarted = server.start(launch.argv("image", "serve", "run"), launch.environ(), out, changed)
        status = server.read_status()
    return out.result(running=True, pid=pid, bind=status.get("bind"), port=status.get("port"),
                      store=status.get("store"), restarted=restarted,
                      **_urls(status.get("bind"), status.get("port")))


@command("image", "serve", "stop")
@command("blob", "serve", "stop")
def cmd_stop(args, out) -> int:
    """``blob serve stop`` (also ``image serve stop``): stop the blob server if it runs.

    Result: ``{"running": false, "stopped": bool, "pid": N | null}``.
    """
    server = server_daemon()
    if not os.path.isdir(server.home):
        return out.result(running=False, stopped=False, pid=None)
    with server.control():
        pid = server.stop()
    return out.result(running=False, stopped=pid is not None, pid=pid)


@command("image", "serve", "status")
@command("blob", "serve", "status")
def cmd_status(args, out) -> int:
    """``blob serve status`` (also ``image serve status``): is the blob server running, and where.

    Result: ``{"running", "pid", "bind", "port", "url", "blobs_url", "store",
    "token", "version", "started_at"}`` (``token``: whether one is required).
    """
    server = server_daemon()
    running, pid = server.running()
    status = server.read_status() if running else {}
    port = status.get("port")
    urls = _urls(status["bind"], port) if running and port else {"url": None, "blobs_url": None}
    return out.result(running=running, pid=pid, bind=status.get("bind"), port=port,
                      store=status.get("store"), token=bool(status.get("token")),
                      version=status.get("version"), started_at=status.get("started_at"), **urls)


@command("image", "serve", "run")
@command("blob", "serve", "run")
def cmd_run(args, out) -> int:
    """``blob serve run`` (also ``image serve run``): the server in the
    foreground (what ``start`` runs detached).  Ends on SIGTERM with
    ``{"running": false}``."""
    server = server_daemon()
    config = server.read_config()
    if not config:
        raise AgentError(NOT_RETRYABLE, "the blob server is not configured: use `blob serve start`")
    with server.serving() as mine:
        if not mine:
            raise AgentError(RETRYABLE, "a blob server is already running (%s)" % server.run_lock)
        server.rotate_log_if_big()
        adopt_old_images(config["store"])
        base = {"pid": os.getpid(), "version": get_version(), "bind": config["bind"], "store": config["store"]}
        try:
            httpd = Server(config["bind"], int(config["port"]), config["store"], config.get("token_file"),
                           on_tick=server.rotate_log_if_big)
        except OSError as exc:
            kind = ADDRESS_IN_USE if exc.errno == errno.EADDRINUSE else NOT_RETRYABLE
            message = "cannot listen on %s port %s: %s" % (config["bind"], config["port"], exc.strerror or exc)
            server.write_status(dict(base, running=False, error={"kind": kind, "message": message}))
            raise AgentError(kind, message)
        port = httpd.server_address[1]
        server.write_status(dict(base, running=True, port=port, token=bool(config.get("token_file")),
                                 started_at=round(time.time(), 3)))
        httpd.log("serving %s on %s" % (config["store"], _urls(config["bind"], port)["blobs_url"]))

        def stop(signum, frame):
            threading.Thread(target=httpd.shutdown, daemon=True).start()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        try:
            httpd.serve_forever(poll_interval=0.5)
        finally:
            httpd.server_close()
            server.write_status(dict(base, running=False, port=port))
    return out.result(running=False)
