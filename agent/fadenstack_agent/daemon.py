"""The agent's daemons (the heartbeat, the blob server): one helper for their
files, their start / stop / status and their own side while they run.

A daemon named N keeps under the agent home: ``N.json`` (its configuration,
mode 0600), ``N.pid``, ``N.status.json`` (written by the daemon), ``N.log``
(its stdout and stderr), ``N.lock`` (held while a command starts or stops
it) and ``N.run.lock``, on which the daemon holds an exclusive ``flock`` for
its whole life, so "is it running?" never depends on a stale pidfile; the
pidfile only says which process holds the lock.  These names are what agents
already running on machines use: a new agent must find their daemons.
"""

import contextlib
import os
import signal
import time

from . import get_version
from .files import (Layout, Locked, agent_home, atomic_write, read_json, remove_quietly, try_lock,
                    unlock, write_json)
from .protocol import RETRYABLE, AgentError

START_WAIT = 10.0
CONTROL_WAIT = 30.0
LOG_MAX_BYTES = 1024 * 1024


class Daemon:
    """One daemon's files and life, as seen from the commands and from itself."""

    def __init__(self, name: str, title: str, home=None):
        self.name, self.title = name, title
        self.home = home or agent_home()
        base = os.path.join(self.home, name)
        self.config = base + ".json"
        self.pid = base + ".pid"
        self.status = base + ".status.json"
        self.log = base + ".log"
        self.lock = base + ".lock"
        self.run_lock = base + ".run.lock"

    def files(self) -> list:
        return [self.config, self.pid, self.log, self.log + ".1", self.status, self.lock, self.run_lock]

    # -------------------------------------------------------------- the commands' side

    def control(self) -> Locked:
        """``with daemon.control():`` one start / stop of this daemon at a time."""
        Layout(self.home).ensure_home()
        return Locked(self.lock, CONTROL_WAIT, "another start/stop of %s is still running on this machine"
                      % self.title)

    def running(self):
        """``(False, None)``, or ``(True, pid)`` (pid None when it cannot be told)."""
        if not os.path.isdir(self.home):
            return False, None
        return holder(self.run_lock, self.pid)

    def read_config(self):
        return read_json(self.config)

    def write_config(self, config: dict) -> bool:
        """Store the configuration (mode 0600: it may name secrets); True when it changed."""
        changed = self.read_config() != config
        if changed or not os.path.exists(self.config):
            write_json(self.config, config, 0o600)
        os.chmod(self.config, 0o600)
        return changed

    def read_status(self) -> dict:
        return read_json(self.status) or {}

    def restart_reasons(self, pid, changed: bool) -> list:
        """Why the running daemon (``pid``) is not the one wanted; [] when it is."""
        status = self.read_status()
        reasons = []
        if changed:
            reasons.append("its configuration changed")
        if status.get("version") != get_version():
            reasons.append("it runs agent %s, this is %s" % (status.get("version") or "unknown", get_version()))
        if pid is None or status.get("pid") != pid or not status.get("running"):
            reasons.append("its state file does not match it")
        return reasons

    def start(self, argv: list, env: dict, out, changed: bool, secret=None, trust_alive=False):
        """Leave the wanted daemon running (call under ``control()``): ``(pid, restarted)``.

        A running daemon with the same configuration and agent version is left
        alone; any other is stopped and started again.  The new one counts as
        up once its status file says so; an error it wrote there is raised
        with its kind (``address_in_use``...).  ``trust_alive``: a daemon still
        alive after START_WAIT s counts as up too.
        """
        running, pid = self.running()
        restarted = False
        if running:
            reasons = self.restart_reasons(pid, changed)
            if not reasons:
                return pid, False
            out.log("restarting %s (pid %s): %s" % (self.title, pid, "; ".join(reasons)))
            if pid is None or not terminate(pid):
                raise AgentError(RETRYABLE, "could not stop the running %s (pid %s)" % (self.title, pid))
            restarted = True
        pid = spawn_detached(argv, env, self.log, cwd=self.home)
        deadline = time.monotonic() + START_WAIT
        while time.monotonic() < deadline:
            status = self.read_status()
            if status.get("pid") == pid and status.get("running"):
                return pid, restarted
            error = status.get("error") if status.get("pid") == pid else None
            if isinstance(error, dict):
                raise AgentError(error.get("kind", RETRYABLE), error.get("message", "?"))
            if not pid_alive(pid):
                break
            time.sleep(0.05)
        if trust_alive and pid_alive(pid):
            return pid, restarted
        raise AgentError(RETRYABLE, "%s exited right after starting: %s"
                         % (self.title, self.log_tail(secret) or "no output"))

    def stop(self):
        """Stop the daemon if it runs (call under ``control()``); its pid, or None."""
        running, pid = self.running()
        if not running:
            return None
        if pid is None:
            raise AgentError(RETRYABLE, "%s holds %s but its pid is unknown" % (self.title, self.run_lock))
        if not terminate(pid):
            raise AgentError(RETRYABLE, "%s (pid %d) did not stop" % (self.title, pid))
        if read_pid(self.pid) == pid:
            remove_quietly(self.pid)
        return pid

    def log_tail(self, secret=None, lines: int = 3) -> str:
        """The last lines of the log on one line, ``secret`` blotted out."""
        try:
            with open(self.log, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 4096))
                text = fh.read().decode("utf-8", "replace")
        except OSError:
            return ""
        text = " | ".join(ln.strip() for ln in text.splitlines()[-lines:] if ln.strip())
        return text.replace(secret, "[token]") if secret else text

    # -------------------------------------------------------------- the daemon's own side

    @contextlib.contextmanager
    def serving(self):
        """``with daemon.serving() as mine:`` hold the run lock and the pidfile for
        the daemon's life; ``mine`` is False when another daemon holds them."""
        fd = try_lock(self.run_lock)
        if fd is None:
            yield False
            return
        pid = os.getpid()
        try:
            atomic_write(self.pid, ("%d\n" % pid).encode("ascii"), 0o644)
            yield True
        finally:
            if read_pid(self.pid) == pid:
                remove_quietly(self.pid)
            unlock(fd)

    def write_status(self, status: dict) -> None:
        try:
            write_json(self.status, status, 0o644)
        except OSError:
            pass          # a full disk must not stop the daemon; the next write may succeed

    def rotate_log_if_big(self) -> None:
        """Keep one old log (``N.log.1``) once the log passes LOG_MAX_BYTES.

        Only when our stdout is that log (a daemon, not a test in a terminal):
        the file is renamed and stdout / stderr moved to a fresh one."""
        try:
            out, st = os.fstat(1), os.stat(self.log)
        except OSError:
            return
        if (out.st_dev, out.st_ino) != (st.st_dev, st.st_ino) or st.st_size < LOG_MAX_BYTES:
            return
        try:
            os.replace(self.log, self.log + ".1")
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError:
            return
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)


# ------------------------------------------------------------------ processes


def read_pid(path: str):
    try:
        with open(path, "r") as fh:
            value = int(fh.read().strip() or "0")
    except (OSError, ValueError):
        return None
    return value if value > 0 else None


def pid_alive(pid) -> bool:
    """True for a live (non-zombie) process."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open("/proc/%d/stat" % pid, "r") as fh:
            stat = fh.read()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _lock_holder_from_proc_locks(path: str):
    try:
        st = os.stat(path)
        with open("/proc/locks", "r") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4242 00:2f:1234 0 EOF"
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5].rsplit(":", 1)[-1] == str(st.st_ino):
            try:
                return int(parts[4])
            except ValueError:
                continue
    return None


def holder(lock_path: str, pid_path: str, wait: float = 3.0):
    """Is a daemon holding ``lock_path``?  ``(False, None)`` or ``(True, pid-or-None)``.

    A daemon just started may hold the lock before it wrote its pidfile:
    wait up to ``wait`` s for it, then ask /proc/locks."""
    fd = try_lock(lock_path)
    if fd is not None:
        unlock(fd)
        return False, None
    deadline = time.monotonic() + wait
    while True:
        pid = read_pid(pid_path)
        if pid and pid_alive(pid):
            return True, pid
        if time.monotonic() >= deadline:
            break
        fd = try_lock(lock_path)
        if fd is not None:
            unlock(fd)
            return False, None
        time.sleep(0.05)
    pid = _lock_holder_from_proc_locks(lock_path)
    return True, pid if pid and pid_alive(pid) else None


def terminate(pid: int, timeout: float = 10.0) -> bool:
    """SIGTERM, then SIGKILL after ``timeout`` s; True once the process is gone."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return True
            time.sleep(0.05)
    return not pid_alive(pid)


def spawn_detached(argv: list, env: dict, log_path: str, cwd: str = "/") -> int:
    """Start ``argv`` as a daemon (double fork + setsid, stdin /dev/null, stdout
    and stderr appended to ``log_path``); returns the daemon's pid."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:                                    # first child
        try:
            os.close(read_end)
            os.setsid()
            if os.fork() != 0:
                os._exit(0)
            os.chdir(cwd)                             # grandchild: the daemon
            os.umask(0o022)
            null = os.open(os.devnull, os.O_RDONLY)
            log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.close(null)
            os.close(log)
            os.write(write_end, str(os.getpid()).encode("ascii"))
            os.close(write_end)
            os.execve(argv[0], argv, env)
        except BaseException:
            pass
        os._exit(127)
    os.close(write_end)
    try:
        os.waitpid(child, 0)
        data = b""
        while True:
            chunk = os.read(read_end, 64)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(read_end)
    if not data:
        raise OSError("the daemon process could not be started")
    return int(data.decode("ascii"))
