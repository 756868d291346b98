"""Process plumbing for the heartbeat daemon: locks, pid checks, detaching.

The daemon holds an exclusive ``flock`` on ``heartbeat.run.lock`` for its whole
life, so "is it running?" never depends on a stale pidfile; the pidfile only
says which process holds the lock.
"""

import errno
import fcntl
import os
import signal
import time


def try_lock(path: str):
    """Take an exclusive flock without waiting; the open fd, or None if held."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def lock_waiting(path: str, timeout: float = 30.0):
    """Take an exclusive flock, waiting up to ``timeout`` s; the fd or None."""
    deadline = time.monotonic() + timeout
    while True:
        fd = try_lock(path)
        if fd is not None or time.monotonic() >= deadline:
            return fd
        time.sleep(0.05)


def unlock(fd) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


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


def cmdline(pid) -> list:
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as fh:
            raw = fh.read()
    except OSError:
        return []
    return [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]


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
    """Is the daemon running?  ``(False, None)`` or ``(True, pid-or-None)``."""
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
