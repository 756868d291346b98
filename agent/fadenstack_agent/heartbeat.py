"""``heartbeat start|stop|status``: keep a small daemon posting "I am alive"
to the console.  The loop itself (``heartbeat run``) lives in ``beat``.

Files under the agent home: ``heartbeat.json`` (mode 0600: url, interval,
token), ``heartbeat.pid``, ``heartbeat.status.json`` (written by the daemon,
never holds the token), ``heartbeat.log``, and the boot hooks (``install``).
The token only ever arrives on stdin, so it never shows in ``ps``.
"""

import json
import os
import select
import time
import urllib.parse

from . import daemon, get_version, install
from .paths import Layout, atomic_write
from .protocol import BAD_INPUT, RETRYABLE, AgentError

MIN_INTERVAL, MAX_INTERVAL = 1.0, 3600.0
TOKEN_WAIT = 30.0
START_WAIT = 10.0


def parse_interval(text: str):
    """argparse type for ``--interval``: seconds, 1..3600 (int when whole)."""
    try:
        value = float(text)
    except (TypeError, ValueError):
        value = float("nan")
    if not (MIN_INTERVAL <= value <= MAX_INTERVAL):
        import argparse
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


def load_config(layout: Layout):
    """heartbeat.json as a dict, or None when absent or unusable."""
    try:
        with open(layout.heartbeat_config, "r", encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not all(k in data for k in ("url", "interval", "token")):
        return None
    return data


def read_status(layout: Layout) -> dict:
    try:
        with open(layout.heartbeat_status, "r", encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def log_tail(layout: Layout, secret=None, lines: int = 3) -> str:
    try:
        with open(layout.heartbeat_log, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 4096))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return ""
    text = " | ".join(ln.strip() for ln in text.splitlines()[-lines:] if ln.strip())
    return text.replace(secret, "[token]") if secret else text


class _Locked:
    """``with _Locked(layout):`` serialises start / stop / uninstall."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.fd = None

    def __enter__(self):
        self.layout.ensure_home()
        self.fd = daemon.lock_waiting(self.layout.heartbeat_lock, timeout=30.0)
        if self.fd is None:
            raise AgentError(RETRYABLE, "another heartbeat start/stop is still running on this machine")
        return self

    def __exit__(self, *exc):
        daemon.unlock(self.fd)
        return False


def _running(layout: Layout):
    return daemon.holder(layout.run_lock, layout.heartbeat_pid)


def _spawn(layout: Layout, launch, token: str) -> int:
    pid = daemon.spawn_detached(launch.argv(), launch.environ(), layout.heartbeat_log, cwd=layout.home)
    deadline = time.monotonic() + START_WAIT
    while time.monotonic() < deadline:
        status = read_status(layout)
        if status.get("pid") == pid and status.get("running"):
            return pid
        if not daemon.pid_alive(pid):
            break
        time.sleep(0.05)
    if daemon.pid_alive(pid):
        return pid
    raise AgentError(RETRYABLE, "the heartbeat daemon exited right after starting: %s"
                     % (log_tail(layout, token) or "no output"))


def cmd_start(args, out) -> int:
    """``heartbeat start --url URL [--interval S]`` (token on stdin).

    Writes heartbeat.json, installs the boot hooks, points current.pyz at this
    zip and starts the daemon; restarts it when the config or the agent version
    changed; a no-op when the same daemon already runs.
    Result: ``{"running": true, "pid": N, "restarted": bool}``.
    """
    url = validate_url(args.url)
    token = read_token()
    layout = Layout()
    new = {"url": url, "interval": args.interval, "token": token}
    with _Locked(layout):
        old = load_config(layout)
        changed = old != new
        if changed or not os.path.exists(layout.heartbeat_config):
            atomic_write(layout.heartbeat_config, (json.dumps(new, indent=2) + "\n").encode("utf-8"), 0o600)
        os.chmod(layout.heartbeat_config, 0o600)
        launch = install.Launch(layout)
        install.update_current_link(layout)
        install.install_autostart(layout, launch)
        install.install_systemd(layout, launch, out.log)
        running, pid = _running(layout)
        restarted = False
        if running:
            status = read_status(layout)
            reasons = []
            if changed:
                reasons.append("its configuration changed")
            if status.get("version") != get_version():
                reasons.append("it runs agent %s, this is %s" % (status.get("version") or "unknown", get_version()))
            if pid is None or status.get("pid") != pid:
                reasons.append("its state file does not match it")
            if not reasons:
                return out.result(running=True, pid=pid, restarted=False)
            out.log("restarting the heartbeat daemon (pid %s): %s" % (pid, "; ".join(reasons)))
            if pid is None or not daemon.terminate(pid):
                raise AgentError(RETRYABLE, "could not stop the running heartbeat daemon (pid %s)" % pid)
            restarted = True
        pid = _spawn(layout, launch, token)
        return out.result(running=True, pid=pid, restarted=restarted)


def stop_daemon(layout: Layout):
    """Stop the daemon if it runs; its pid (or None)."""
    running, pid = _running(layout)
    if not running:
        return None
    if pid is None:
        raise AgentError(RETRYABLE, "a heartbeat daemon holds %s but its pid is unknown" % layout.run_lock)
    if not daemon.terminate(pid):
        raise AgentError(RETRYABLE, "the heartbeat daemon (pid %d) did not stop" % pid)
    if daemon.read_pid(layout.heartbeat_pid) == pid:
        try:
            os.unlink(layout.heartbeat_pid)
        except OSError:
            pass
    return pid


def cmd_stop(args, out) -> int:
    """``heartbeat stop``: stop the daemon (boot hooks stay; ``uninstall`` removes them).

    Result: ``{"running": false, "stopped": bool, "pid": N or null}``.
    """
    layout = Layout()
    if not os.path.isdir(layout.home):
        return out.result(running=False, stopped=False, pid=None)
    with _Locked(layout):
        pid = stop_daemon(layout)
    return out.result(running=False, stopped=pid is not None, pid=pid)


def cmd_status(args, out) -> int:
    """``heartbeat status``: is it configured and running, and how it fares.

    Result: ``{"configured", "running", "pid", "url", "interval", "version",
    "started_at", "last_ok_at", "last_error", "consecutive_failures",
    "autostart"}`` (never the token).
    """
    layout = Layout()
    config = load_config(layout) or {}
    running, pid = _running(layout) if os.path.isdir(layout.home) else (False, None)
    status = read_status(layout) if running else {}
    return out.result(
        configured=bool(config), running=running, pid=pid,
        url=config.get("url"), interval=config.get("interval"),
        version=status.get("version"), started_at=status.get("started_at"),
        last_ok_at=status.get("last_ok_at"), last_error=status.get("last_error"),
        consecutive_failures=status.get("consecutive_failures"),
        autostart=os.access(layout.autostart_hook, os.X_OK),
    )
