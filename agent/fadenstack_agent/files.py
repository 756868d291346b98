"""Where the agent keeps things on the machine, and how it writes them.

Home: ``/opt/fadenstack`` as root, else ``~/.fadenstack``; overridden by the
environment variable ``FADEN_AGENT_HOME`` (tests, development installs).
Store: ``--store`` > ``FADEN_AGENT_STORE`` > ``"store"`` in the machine config
> ``/var/lib/fadenstack`` as root, else ``<home>/store``.  Under it:
``blobs/`` (content-addressed files, see ``blobstore``) and ``runtime/`` (the
loaded image, the runtime's and Ray's records).
Machine config: ``/etc/fadenstack/agent.json`` (``FADEN_AGENT_CONFIG``
overrides the path), e.g. ``{"runtime_driver": "process"}``.

Files that another process may read while they change are replaced in one
step (a temporary file, then a rename), so a reader sees the old content or
the new, never half of it.  Locks are ``flock``s: the kernel drops them with
the process, so a crash never leaves a stale lock behind.
"""

import errno
import fcntl
import json
import os
import tempfile
import time

from .protocol import NOT_RETRYABLE, RETRYABLE, AgentError

SYSTEM_HOME = "/opt/fadenstack"
SYSTEM_STORE = "/var/lib/fadenstack"
MACHINE_CONFIG = "/etc/fadenstack/agent.json"
ENV_HOME = "FADEN_AGENT_HOME"
ENV_STORE = "FADEN_AGENT_STORE"
ENV_CONFIG = "FADEN_AGENT_CONFIG"
MiB = 1024 * 1024


# ------------------------------------------------------------------ where things are


def is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def agent_home() -> str:
    """The agent's home directory (not created here)."""
    env = os.environ.get(ENV_HOME)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    if is_root():
        return SYSTEM_HOME
    return os.path.join(os.path.expanduser("~"), ".fadenstack")


def is_system_install(home: str) -> bool:
    """True for the root install in /opt/fadenstack (the only one that may touch
    system-wide things such as systemd units)."""
    return is_root() and not os.environ.get(ENV_HOME) and home == SYSTEM_HOME


def machine_config_path() -> str:
    return os.environ.get(ENV_CONFIG) or MACHINE_CONFIG


def load_machine_config() -> dict:
    """The optional machine config as a dict ({} when the file is absent)."""
    path = machine_config_path()
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise AgentError(NOT_RETRYABLE, "cannot read %s: %s" % (path, exc.strerror or exc))
    try:
        data = json.loads(raw.decode("utf-8") or "{}")
    except ValueError as exc:
        raise AgentError(NOT_RETRYABLE, "%s is not valid JSON: %s" % (path, exc))
    if not isinstance(data, dict):
        raise AgentError(NOT_RETRYABLE, "%s must hold a JSON object" % path)
    return data


def store_dir(override=None, config=None) -> str:
    """The store directory (not created here)."""
    if override:
        return os.path.abspath(os.path.expanduser(override))
    env = os.environ.get(ENV_STORE)
    if env:
        return os.path.abspath(os.path.expanduser(env))
    if config is None:
        config = load_machine_config()
    if isinstance(config.get("store"), str) and config["store"]:
        return os.path.abspath(config["store"])
    if is_root():
        return SYSTEM_STORE
    return os.path.join(agent_home(), "store")


def blobs_dir(store: str) -> str:
    """Content-addressed files of any kind (runtime images, model files)."""
    return os.path.join(store, "blobs")


def runtime_dir(store: str) -> str:
    """The runtime's records: ``loaded.json``, ``state.json``, ``ray.json``, ``ray.lock``."""
    return os.path.join(store, "runtime")


# The zipapp this code came from when it runs from the copy unpacked beside it (set by the zip's
# ``__main__``, agent/zipmain.py); None otherwise.
ZIP_PATH = None


def _package_parent() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def running_zip():
    """Absolute path of the zipapp this code runs from (or was unpacked from), or None from a source tree."""
    if ZIP_PATH:
        return ZIP_PATH
    parent = _package_parent()
    return parent if os.path.isfile(parent) else None


def source_root():
    """The directory holding the ``fadenstack_agent`` package, or None when zipped."""
    if ZIP_PATH:
        return None
    parent = _package_parent()
    return parent if os.path.isdir(parent) else None


class Layout:
    """File names under the agent home (the daemons' own files: ``daemon.Daemon``)."""

    def __init__(self, home=None):
        self.home = home or agent_home()
        self.agent_dir = os.path.join(self.home, "agent")
        self.current_link = os.path.join(self.agent_dir, "current.pyz")
        self.autostart_dir = os.path.join(self.home, "autostart.d")
        self.autostart_hook = os.path.join(self.autostart_dir, "heartbeat")

    def ensure_home(self) -> None:
        os.makedirs(self.home, mode=0o755 if is_root() else 0o700, exist_ok=True)


# ------------------------------------------------------------------ writing


def atomic_write(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` via a temporary file and rename, with ``mode``,
    fsynced (file and directory) so that it survives a power cut."""
    directory = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", dir=directory)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    fsync_dir(directory)


def replace_quickly(path: str, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` in one step without fsync, through the fixed temporary
    name ``.<name>.tmp``: for a record rewritten many times a second by its one
    writer (a fetch's state after each chunk), where a lost update is only
    work to redo."""
    tmp = os.path.join(os.path.dirname(path) or ".", "." + os.path.basename(path) + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, path)


def atomic_symlink(target: str, link: str) -> bool:
    """Point ``link`` at ``target`` (create a temporary symlink, rename it over).

    Returns True when the link changed.
    """
    try:
        if os.readlink(link) == target:
            return False
    except OSError:
        pass
    directory = os.path.dirname(link) or "."
    tmp = os.path.join(directory, ".%s.%d.tmp" % (os.path.basename(link), os.getpid()))
    remove_quietly(tmp)
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_dir(directory)
    return True


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (best effort)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_quietly(path: str) -> bool:
    """Unlink a file or symlink; True when something was removed."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def read_json(path: str):
    """A JSON object from ``path``; None when absent, unreadable or not an object."""
    try:
        with open(path, "rb") as fh:
            data = json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: str, data: dict, mode: int = 0o644) -> None:
    """Write a JSON object with ``atomic_write``, creating its directory."""
    os.makedirs(os.path.dirname(path) or ".", mode=0o755, exist_ok=True)
    atomic_write(path, (json.dumps(data, indent=2, sort_keys=True) + "\n").encode("utf-8"), mode)


# ------------------------------------------------------------------ room


def free_bytes(path: str) -> int:
    """Free bytes (for an unprivileged writer) of the file system holding
    ``path``, or of its nearest existing parent."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def human(n) -> str:
    """Bytes for people: ``256.0 MiB`` (GiB from 10 GiB on)."""
    if n >= 10 * 1024 * MiB:
        return "%.1f GiB" % (n / (1024.0 * MiB))
    return "%.1f MiB" % (n / float(MiB))


# ------------------------------------------------------------------ locks


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


class Locked:
    """``with Locked(path, wait, busy):`` one holder at a time; after ``wait`` s
    the caller gets ``AgentError(retryable, busy)`` (someone else is at it)."""

    def __init__(self, path: str, wait: float, busy: str):
        self.path, self.wait, self.busy = path, wait, busy
        self.fd = None

    def __enter__(self):
        os.makedirs(os.path.dirname(self.path) or ".", mode=0o755, exist_ok=True)
        self.fd = lock_waiting(self.path, self.wait)
        if self.fd is None:
            raise AgentError(RETRYABLE, self.busy)
        return self

    def __exit__(self, *exc):
        unlock(self.fd)
        self.fd = None
        return False
