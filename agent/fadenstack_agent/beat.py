"""``heartbeat run``: the foreground loop the heartbeat daemon execs.

Every ``interval`` s (first beat at once) it POSTs
``{"agent_version", "hostname", "uptime_s", "boot_id", "runtime",
"gpu_processes"}`` as JSON to
the url with ``Authorization: Bearer <token>``; failures are logged (one line,
the token never written) and the loop keeps going.  ``runtime`` (agent 0.3) is
the runtime container's state and whether this machine's Ray node is alive,
found cheaply (``runtimebeat``: processes and one TCP connect, never a Ray
client), so that the console sees a dead Ray within a beat; ``gpu_processes``
(agent 0.9, ``gpuprocs``) the processes on the GPUs, read every 10 s at most and
sent on the beats that read them.  heartbeat.json is re-read
when it changes; the loop ends on SIGTERM / SIGINT or when the file goes.
"""

import json
import os
import signal
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

from . import get_version
from .cli import command
from .facts import run_tool
from .gpuprocs import GpuWatch
from .heartbeat import heartbeat_daemon, load_config
from .pinning import PinnedHTTPSHandler
from .protocol import NOT_RETRYABLE, AgentError
from .runtimebeat import RuntimeWatch

HTTP_TIMEOUT = 5.0
TICK = 0.5
REPEAT_LOG_EVERY = 300.0


def _read_first(path: str) -> str:
    try:
        with open(path, "r") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def beat_payload(watch=None, gpus=None) -> dict:
    """One beat's body; with a ``RuntimeWatch``, its ``runtime`` section too, and with a ``GpuWatch``
    that read the GPUs' processes on this beat, ``gpu_processes``."""
    uptime = _read_first("/proc/uptime").split()
    payload = {
        "agent_version": get_version(),
        "hostname": socket.gethostname(),
        "uptime_s": int(float(uptime[0])) if uptime else None,
        "boot_id": _read_first("/proc/sys/kernel/random/boot_id") or None,
    }
    if watch is not None:
        payload["runtime"] = watch.report()
    processes = gpus.report() if gpus is not None else None
    if processes is not None:
        payload["gpu_processes"] = processes
    return payload


def display_url(url: str) -> str:
    """The url without credentials or query string, for logs."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = "[%s]" % host
    if parts.port:
        host += ":%d" % parts.port
    return "%s://%s%s" % (parts.scheme, host, parts.path)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """Never follow redirects: they would carry the bearer token elsewhere."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class BeatFailed(Exception):
    pass


def send_beat(opener, config: dict, payload: dict) -> int:
    """POST one heartbeat; the HTTP status, or BeatFailed with a readable reason."""
    request = urllib.request.Request(
        config["url"], data=json.dumps(payload).encode("utf-8"), method="POST",
        headers={"Authorization": "Bearer " + config["token"],
                 "Content-Type": "application/json",
                 "User-Agent": "fadenstack-agent/" + get_version()})
    try:
        with opener.open(request, timeout=HTTP_TIMEOUT) as response:
            response.read(65536)
            return response.status
    except urllib.error.HTTPError as exc:
        raise BeatFailed("HTTP %d %s" % (exc.code, exc.reason))
    except urllib.error.URLError as exc:
        raise BeatFailed(str(exc.reason))
    except socket.timeout:
        raise BeatFailed("no answer within %g s" % HTTP_TIMEOUT)
    except (OSError, ValueError) as exc:
        raise BeatFailed("%s: %s" % (type(exc).__name__, exc))


class Runner:
    """The daemon loop; ``run()`` returns the exit code."""

    def __init__(self, out, daemon=None):
        self.out = out
        self.daemon = daemon or heartbeat_daemon()
        self.opener = None  # made for each configuration: its pin (pinning.py)
        self.stopping = False
        self.config = None
        self.signature = None
        self.status = {}
        self.last_logged = None
        self.last_log_at = 0.0
        self.watch = RuntimeWatch()
        self.watch_error = None
        self.gpus = GpuWatch(run_tool)
        self.gpus_error = None

    def _opener(self):
        pin = (self.config or {}).get("pin") or ""
        if self.opener is None or getattr(self.opener, "pin", None) != pin:
            handlers = [_NoRedirect] + ([PinnedHTTPSHandler(pin)] if pin else [])
            self.opener = urllib.request.build_opener(*handlers)
            self.opener.pin = pin
        return self.opener

    def log(self, message: str) -> None:
        token = (self.config or {}).get("token")
        self.out.log(message.replace(token, "[token]") if token else message)

    def _signature(self):
        try:
            st = os.stat(self.daemon.config)
        except OSError:
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _on_signal(self, signum, frame):
        self.stopping = True

    def write_status(self) -> None:
        self.daemon.write_status(self.status)

    def run(self) -> int:
        self.config = load_config(self.daemon)
        self.signature = self._signature()
        if self.config is None:
            raise AgentError(NOT_RETRYABLE, "heartbeat is not configured (no usable %s): run "
                             "`heartbeat start` first" % self.daemon.config)
        with self.daemon.serving() as mine:
            if not mine:
                _, pid = self.daemon.running()
                self.log("another heartbeat daemon already runs (pid %s); leaving it be" % pid)
                return self.out.result(running=True, pid=pid, started=False)
            self._serve()
        self.log("heartbeat daemon stopped")
        return self.out.result(running=False, stopped=True, beats=self.status.get("beats", 0))

    def _serve(self) -> None:
        pid = os.getpid()
        try:
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, self._on_signal)
            self.status = {"running": True, "pid": pid, "version": get_version(),
                           "started_at": time.time(), "url": display_url(self.config["url"]),
                           "interval": self.config["interval"], "beats": 0, "last_ok_at": None,
                           "last_error": None, "consecutive_failures": 0}
            self.write_status()
            self.log("heartbeat daemon started (pid %d, agent %s): %s every %s s"
                     % (pid, get_version(), display_url(self.config["url"]), self.config["interval"]))
            self.loop()
        finally:
            self.status.update(running=False, stopped_at=time.time())
            self.write_status()

    def loop(self) -> None:
        next_beat = time.monotonic()
        last_rotate_check = 0.0
        while not self.stopping:
            now = time.monotonic()
            if self.reload_if_changed():
                next_beat = now
            if self.stopping:
                break
            if now >= next_beat:
                self.beat_once()
                next_beat += float(self.config["interval"])
                if next_beat <= time.monotonic():
                    next_beat = time.monotonic() + float(self.config["interval"])
            if now - last_rotate_check >= 60:
                last_rotate_check = now
                self.daemon.rotate_log_if_big()
            time.sleep(max(0.0, min(TICK, next_beat - time.monotonic())))

    def reload_if_changed(self) -> bool:
        signature = self._signature()
        if signature == self.signature:
            return False
        self.signature = signature
        if signature is None:
            self.log("%s was removed; stopping" % self.daemon.config)
            self.stopping = True
            return False
        config = load_config(self.daemon)
        if config is None:
            self.log("%s is not usable; keeping the previous settings" % self.daemon.config)
            return False
        if config == self.config:
            return False
        what = [k for k in ("url", "interval", "token") if config.get(k) != self.config.get(k)]
        self.log("configuration changed (%s): now %s every %s s"
                 % (", ".join(what), display_url(config["url"]), config["interval"]))
        self.config = config
        self.status.update(url=display_url(config["url"]), interval=config["interval"])
        return True

    def beat_once(self) -> None:
        payload = beat_payload(self.watch, self.gpus)
        if self.watch.error != self.watch_error:
            if self.watch.error:
                self.log("the heartbeat cannot tell the runtime's state: %s" % self.watch.error)
            self.watch_error = self.watch.error
        if self.gpus.error != self.gpus_error:
            if self.gpus.error:
                self.log("the heartbeat cannot tell which processes use the GPUs: %s" % self.gpus.error)
            self.gpus_error = self.gpus.error
        try:
            send_beat(self._opener(), self.config, payload)
        except BeatFailed as exc:
            self.failed(str(exc))
        else:
            failures = self.status["consecutive_failures"]
            if failures:
                self.log("heartbeat delivered again after %d failed attempt(s)" % failures)
            elif self.status["beats"] == 0:
                self.log("first heartbeat delivered to %s" % display_url(self.config["url"]))
            self.status.update(last_ok_at=time.time(), consecutive_failures=0, last_error=None)
            self.last_logged = None
        self.status["beats"] += 1
        self.write_status()

    def failed(self, message: str) -> None:
        token = self.config.get("token")
        if token:
            message = message.replace(token, "[token]")
        self.status["consecutive_failures"] += 1
        self.status["last_error"] = message
        now = time.monotonic()
        if message != self.last_logged or now - self.last_log_at >= REPEAT_LOG_EVERY:
            count = self.status["consecutive_failures"]
            self.log("heartbeat to %s failed: %s%s" % (display_url(self.config["url"]), message,
                     " (%d failures in a row)" % count if count > 1 else ""))
            self.last_logged, self.last_log_at = message, now


@command("heartbeat", "run")
def cmd_run(args, out) -> int:
    """``heartbeat run``: the foreground heartbeat loop (what the daemon and the
    boot hooks execute).  Ends with ``{"running": false, "stopped": true,
    "beats": N}`` on SIGTERM, or ``{"running": true, "pid": N, "started":
    false}`` at once when another daemon already runs."""
    return Runner(out).run()
