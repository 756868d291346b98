"""``image serve start|stop|status|run``: every machine's image server.

A small daemon (``run`` is its foreground loop) answering ``GET`` and ``HEAD``
on ``/images/<sha256>`` with ``Range: bytes=a-b`` from the store: the finished
``.img``, or the ``.part`` still arriving, of which it only sends verified
bytes; a range beyond them waits (up to 60 s without news) for the fetch to
verify more, which is how a machine forwards an image while receiving it.
Optional bearer token, read from ``--token-file`` on every request.

Files under the agent home: ``imageserve.json`` (bind, port, store,
token_file), ``imageserve.pid``, ``imageserve.status.json`` (written by the
daemon: pid, port actually bound, or the error that stopped it),
``imageserve.log``, and locks.
"""

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

from . import daemon, get_version
from .imagestore import available
from .install import Launch
from .paths import Layout, atomic_write, store_dir
from .protocol import ADDRESS_IN_USE, BAD_INPUT, NOT_RETRYABLE, RETRYABLE, AgentError, needs_action

ACTIONS = ("start", "stop", "status", "run")
DEFAULT_PORT = 7470
WAIT_FOR_BYTES = 60.0
POLL = 0.02
START_WAIT = 10.0
LOG_MAX_BYTES = 1024 * 1024
PATH_RE = re.compile(r"^/images/([0-9a-f]{64})$")
RANGE_RE = re.compile(r"^\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*$")


class Files:
    def __init__(self, layout=None):
        home = (layout or Layout()).home
        self.home = home
        self.config = os.path.join(home, "imageserve.json")
        self.pid = os.path.join(home, "imageserve.pid")
        self.status = os.path.join(home, "imageserve.status.json")
        self.log = os.path.join(home, "imageserve.log")
        self.lock = os.path.join(home, "imageserve.lock")
        self.run_lock = os.path.join(home, "imageserve.run.lock")


def _read_json(path):
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path, data, mode=0o600):
    atomic_write(path, (json.dumps(data, indent=2) + "\n").encode("utf-8"), mode)


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
    server_version = "fadenstack-imageserve/" + get_version()
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
            return self._plain(404, "Not found: images are at /images/<sha256>")
        if not self._authorized():
            return self._plain(401, "A valid bearer token is needed", [("WWW-Authenticate", "Bearer")])
        digest = m.group(1)
        for _ in range(2):
            held = available(self.server.store, digest)
            if not held:
                return self._plain(404, "Image %s is not held here" % digest)
            path, size, verified, complete = held
            try:
                fh = open(path, "rb")
                break
            except FileNotFoundError:       # renamed .part -> .img just now: look again
                continue
        else:
            return self._plain(404, "Image %s is not held here" % digest)
        with fh:
            rng = parse_range(self.headers.get("Range"), size)
            if rng == "unsatisfiable":
                return self._plain(416, "The image has %d bytes" % size, [("Content-Range", "bytes */%d" % size)])
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

    def __init__(self, bind, port, store, token_file):
        self.address_family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self.store, self.token_file = store, token_file
        self._log_lock = threading.Lock()
        super().__init__((bind, port), Handler)

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


def _url(bind, port):
    host = "[%s]" % bind if ":" in bind else bind
    return "http://%s:%d/images/" % (host, port)


def _port(text):
    import argparse
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError("must be a TCP port from 0 to 65535, got %r" % text)
    return int(text)


def _status_result(out, status, **extra):
    return out.result(running=True, pid=status.get("pid"), bind=status.get("bind"), port=status.get("port"),
                      url=_url(status.get("bind"), status.get("port")), store=status.get("store"), **extra)


def cmd_start(args, out) -> int:
    """``image serve start --bind ADDR [--port 7470] [--store PATH] [--token-file PATH]``.

    Idempotent: the same server already running is left alone; another
    configuration or agent version restarts it.  ``--port 0`` takes a free
    port.  A port held by something else: ``address_in_use``.
    Result: ``{"running": true, "pid", "bind", "port", "url", "store", "restarted"}``.
    """
    try:
        ipaddress.ip_address(args.bind)
    except ValueError:
        raise AgentError(BAD_INPUT, "--bind must be an IP address of this machine (or 0.0.0.0), got %r"
                         % args.bind)
    token_file = os.path.abspath(args.token_file) if args.token_file else None
    if token_file:
        try:
            with open(token_file, "r", encoding="utf-8") as fh:
                ok = bool(fh.read().strip())
        except (OSError, UnicodeDecodeError) as exc:
            raise AgentError(BAD_INPUT, "cannot read --token-file %s: %s" % (token_file, exc))
        if not ok:
            raise AgentError(BAD_INPUT, "--token-file %s is empty" % token_file)
    files = Files()
    config = {"bind": args.bind, "port": args.port, "store": store_dir(args.store), "token_file": token_file}
    Layout(files.home).ensure_home()
    lock = daemon.lock_waiting(files.lock, timeout=30.0)
    if lock is None:
        raise AgentError(RETRYABLE, "another `image serve start/stop` is still running on this machine")
    try:
        running, pid = daemon.holder(files.run_lock, files.pid)
        restarted = False
        if running:
            status = _read_json(files.status) or {}
            if (_read_json(files.config) == config and status.get("pid") == pid and status.get("running")
                    and status.get("version") == get_version()):
                return _status_result(out, status, restarted=False)
            out.log("restarting the image server (pid %s): its configuration or version changed" % pid)
            if pid is None or not daemon.terminate(pid):
                raise AgentError(RETRYABLE, "could not stop the running image server (pid %s)" % pid)
            restarted = True
        _write_json(files.config, config)
        try:
            os.unlink(files.status)
        except FileNotFoundError:
            pass
        launch = Launch(Layout(files.home))
        argv = [launch.python] + launch.program + ["image", "serve", "run"]
        pid = daemon.spawn_detached(argv, launch.environ(), files.log, cwd=files.home)
        deadline = time.monotonic() + START_WAIT
        while time.monotonic() < deadline:
            status = _read_json(files.status) or {}
            if status.get("pid") == pid and status.get("running"):
                return _status_result(out, status, restarted=restarted)
            if status.get("pid") == pid and status.get("error"):
                raise AgentError(status["error"].get("kind", RETRYABLE), status["error"].get("message", "?"))
            if not daemon.pid_alive(pid):
                break
            time.sleep(0.05)
        raise AgentError(RETRYABLE, "the image server did not come up; see %s" % files.log)
    finally:
        daemon.unlock(lock)


def cmd_stop(args, out) -> int:
    """``image serve stop``: stop the image server if it runs.

    Result: ``{"running": false, "stopped": bool, "pid": N | null}``.
    """
    files = Files()
    if not os.path.isdir(files.home):
        return out.result(running=False, stopped=False, pid=None)
    lock = daemon.lock_waiting(files.lock, timeout=30.0)
    try:
        running, pid = daemon.holder(files.run_lock, files.pid)
        if not running:
            return out.result(running=False, stopped=False, pid=None)
        if pid is None or not daemon.terminate(pid):
            raise AgentError(RETRYABLE, "the image server (pid %s) did not stop" % pid)
        if daemon.read_pid(files.pid) == pid:
            os.unlink(files.pid)
        return out.result(running=False, stopped=True, pid=pid)
    finally:
        daemon.unlock(lock)


def cmd_status(args, out) -> int:
    """``image serve status``: is the image server running, and where.

    Result: ``{"running", "pid", "bind", "port", "url", "store", "token",
    "version", "started_at"}`` (``token``: whether one is required).
    """
    files = Files()
    running, pid = daemon.holder(files.run_lock, files.pid) if os.path.isdir(files.home) else (False, None)
    status = (_read_json(files.status) or {}) if running else {}
    port = status.get("port")
    return out.result(running=running, pid=pid, bind=status.get("bind"), port=port,
                      url=_url(status["bind"], port) if running and port else None,
                      store=status.get("store"), token=bool(status.get("token")),
                      version=status.get("version"), started_at=status.get("started_at"))


def cmd_run(args, out) -> int:
    """``image serve run``: the server in the foreground (what ``start`` runs
    detached).  Ends on SIGTERM with ``{"running": false}``."""
    files = Files()
    config = _read_json(files.config)
    if not config:
        raise AgentError(NOT_RETRYABLE, "the image server is not configured: use `image serve start`")
    lock = daemon.try_lock(files.run_lock)
    if lock is None:
        raise AgentError(RETRYABLE, "an image server is already running (%s)" % files.run_lock)
    try:
        if os.path.exists(files.log) and os.path.getsize(files.log) > LOG_MAX_BYTES:
            os.replace(files.log, files.log + ".1")
        with open(files.pid, "w") as fh:
            fh.write("%d\n" % os.getpid())
        base = {"pid": os.getpid(), "version": get_version(), "bind": config["bind"], "store": config["store"]}
        try:
            server = Server(config["bind"], int(config["port"]), config["store"], config.get("token_file"))
        except OSError as exc:
            kind = ADDRESS_IN_USE if exc.errno == errno.EADDRINUSE else NOT_RETRYABLE
            message = "cannot listen on %s port %s: %s" % (config["bind"], config["port"], exc.strerror or exc)
            _write_json(files.status, dict(base, running=False, error={"kind": kind, "message": message}))
            raise AgentError(kind, message)
        port = server.server_address[1]
        _write_json(files.status, dict(base, running=True, port=port, token=bool(config.get("token_file")),
                                       started_at=round(time.time(), 3)))
        server.log("serving %s on %s" % (config["store"], _url(config["bind"], port)))

        def stop(signum, frame):
            threading.Thread(target=server.shutdown, daemon=True).start()

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        try:
            server.serve_forever(poll_interval=0.5)
        finally:
            server.server_close()
            _write_json(files.status, dict(base, running=False, port=port))
        return out.result(running=False)
    finally:
        daemon.unlock(lock)


def add_commands(actions, parser_class) -> None:
    """Add ``image serve ...`` under the ``image`` parser's actions."""
    serve = actions.add_parser("serve", help="the image server daemon", allow_abbrev=False)
    serve.set_defaults(handler=needs_action("image serve", ACTIONS))
    sub = serve.add_subparsers(dest="serve_action", metavar="ACTION", parser_class=parser_class)
    start = sub.add_parser("start", help="start the image server (idempotent)", allow_abbrev=False)
    start.add_argument("--bind", required=True, metavar="ADDR", help="address to listen on (0.0.0.0: all)")
    start.add_argument("--port", type=_port, default=DEFAULT_PORT, help="TCP port (default 7470; 0: any)")
    start.add_argument("--store", metavar="PATH", help="store directory (default: the machine's)")
    start.add_argument("--token-file", metavar="PATH", help="require this bearer token (read per request)")
    start.set_defaults(handler=cmd_start)
    for name, handler, text in (("stop", cmd_stop, "stop the image server"),
                                ("status", cmd_status, "the image server's state"),
                                ("run", cmd_run, "run the image server in the foreground")):
        sub.add_parser(name, help=text, allow_abbrev=False).set_defaults(handler=handler)
