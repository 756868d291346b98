"""``heartbeat start|stop|status``: keep a small daemon posting "I am alive"
to the console.  The loop itself (``heartbeat run``) lives in ``beat``.

Files under the agent home (``daemon.Daemon`` named ``heartbeat``):
``heartbeat.json`` (mode 0600: url, interval, token, pin), ``heartbeat.pid``,
``heartbeat.status.json`` (written by the daemon, never holds the token),
``heartbeat.log``, and the boot hooks (``install``).  The token only ever
arrives on stdin, so it never shows in ``ps``.
"""

import argparse
import os
import select
import time
import urllib.parse

from . import install
from .cli import arg, command, group
from .daemon import Daemon
from .files import Layout
from .pinning import parse_pin
from .protocol import BAD_INPUT, AgentError

MIN_INTERVAL, MAX_INTERVAL = 1.0, 3600.0
TOKEN_WAIT = 30.0

group("heartbeat", help="the heartbeat daemon")


def heartbeat_daemon(home=None) -> Daemon:
    return Daemon("heartbeat", "the heartbeat daemon", home)


def parse_interval(text: str):
    """argparse type for ``--interval``: seconds, 1..3600 (int when whole)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not (MIN_INTERVAL <= value <= MAX_INTERVAL):
        raise argparse.ArgumentTypeError(
            "must be a number of seconds between %g and %g, got %r" % (MIN_INTERVAL, MAX_INTERVAL, text))
    return int(value) if value == int(value) else value


def validate_url(url: str) -> str:
    parts = urllib.parse.urlsplit(url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        raise AgentError(BAD_INPUT, "--url must be an http:// or https:// URL with a host name, got %r" % (url,))
    return url


def read_token(fd: int = 0, wait: float = TOKEN_WAIT) -> str:
    """One line from stdin (read raw, with a deadline, never from argv)."""
    data = b""
    deadline = time.monotonic() + wait
    try:
        while b"\n" not in data and len(data) < 8192:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AgentError(BAD_INPUT, "no token arrived on stdin within %d s: send the machine's "
                                            "heartbeat token as one line on standard input" % wait)
            chunk = os.read(fd, 8192 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    token = data.split(b"\n", 1)[0].decode("utf-8", "replace").strip()
    if not token:
        raise AgentError(BAD_INPUT, "no token on stdin: send the machine's heartbeat token as one "
                                    "line on standard input (it is never taken from the command line)")
    if len(token) > 4096 or any(c.isspace() or ord(c) < 32 for c in token):
        raise AgentError(BAD_INPUT, "the token on stdin must be one line without spaces")
    return token


def load_config(daemon: Daemon):
    """heartbeat.json as a dict, or None when absent or unusable."""
    data = daemon.read_config()
    if not data or not all(k in data for k in ("url", "interval", "token")):
        return None
    return data


# ------------------------------------------------------------------ commands


@command("heartbeat", "start", args=[
    arg("--url", required=True, help="console heartbeat URL"),
    arg("--interval", type=parse_interval, default=10, metavar="SECONDS",
        help="seconds between beats (default 10)"),
    arg("--pin", default="", metavar="SHA256",
        help="the SHA-256 of the console's certificate, for an https:// URL: no other is accepted")])
def cmd_start(args, out) -> int:
    """``heartbeat start --url URL [--interval S] [--pin SHA256]`` (token on stdin):
    configure and start the daemon. With ``--pin`` the beats go only to a
    console showing that certificate (pinning.py).

    Writes heartbeat.json, installs the boot hooks, points current.pyz at this
    zip and starts the daemon; restarts it when the config or the agent version
    changed; a no-op when the same daemon already runs.
    Result: ``{"running": true, "pid": N, "restarted": bool}``.
    """
    url = validate_url(args.url)
    pin = parse_pin(args.pin) if args.pin else ""
    if pin and not url.startswith("https://"):
        raise AgentError(BAD_INPUT, "--pin goes with an https:// URL, got %r" % (url,))
    token = read_token()
    daemon = heartbeat_daemon()
    layout = Layout(daemon.home)
    with daemon.control():
        changed = daemon.write_config({"url": url, "interval": args.interval, "token": token,
                                       **({"pin": pin} if pin else {})})
        launch = install.Launch(daemon.home)
        install.update_current_link(layout)
        install.install_autostart(layout, launch, daemon.log)
        install.install_systemd(layout, launch, out.log)
        pid, restarted = daemon.start(launch.argv("heartbeat", "run"), launch.environ(), out, changed,
                                      secret=token, trust_alive=True)
    return out.result(running=True, pid=pid, restarted=restarted)


@command("heartbeat", "stop")
def cmd_stop(args, out) -> int:
    """``heartbeat stop``: stop the daemon (boot hooks stay; ``uninstall`` removes them).

    Result: ``{"running": false, "stopped": bool, "pid": N or null}``.
    """
    daemon = heartbeat_daemon()
    if not os.path.isdir(daemon.home):
        return out.result(running=False, stopped=False, pid=None)
    with daemon.control():
        pid = daemon.stop()
    return out.result(running=False, stopped=pid is not None, pid=pid)


@command("heartbeat", "status")
def cmd_status(args, out) -> int:
    """``heartbeat status``: is it configured and running, and how it fares.

    Result: ``{"configured", "running", "pid", "url", "interval", "version",
    "started_at", "last_ok_at", "last_error", "consecutive_failures",
    "autostart"}`` (never the token).
    """
    daemon = heartbeat_daemon()
    config = load_config(daemon) or {}
    running, pid = daemon.running()
    status = daemon.read_status() if running else {}
    return out.result(
        configured=bool(config), running=running, pid=pid,
        url=config.get("url"), interval=config.get("interval"),
        version=status.get("version"), started_at=status.get("started_at"),
        last_ok_at=status.get("last_ok_at"), last_error=status.get("last_error"),
        consecutive_failures=status.get("consecutive_failures"),
        autostart=os.access(Layout(daemon.home).autostart_hook, os.X_OK),
    )
