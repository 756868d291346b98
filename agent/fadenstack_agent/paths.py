"""Where the agent keeps things on the machine, and small file helpers.

Home: ``/opt/fadenstack`` as root, else ``~/.fadenstack``; overridden by the
environment variable ``FADEN_AGENT_HOME`` (tests, development installs).
Store: ``--store`` > ``FADEN_AGENT_STORE`` > ``"store"`` in the machine config
> ``/var/lib/fadenstack`` as root, else ``<home>/store``.
Machine config: ``/etc/fadenstack/agent.json`` (``FADEN_AGENT_CONFIG``
overrides the path), e.g. ``{"runtime_driver": "process"}``.
"""

import json
import os
import tempfile

from .protocol import NOT_RETRYABLE, AgentError

SYSTEM_HOME = "/opt/fadenstack"
SYSTEM_STORE = "/var/lib/fadenstack"
MACHINE_CONFIG = "/etc/fadenstack/agent.json"
ENV_HOME = "FADEN_AGENT_HOME"
ENV_STORE = "FADEN_AGENT_STORE"
ENV_CONFIG = "FADEN_AGENT_CONFIG"


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
    """The image/model store directory (not created here)."""
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


def _package_parent() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def running_zip():
    """Absolute path of the zipapp this code runs from, or None from a source tree."""
    parent = _package_parent()
    return parent if os.path.isfile(parent) else None


def source_root():
    """The directory holding the ``fadenstack_agent`` package, or None when zipped."""
    parent = _package_parent()
    return parent if os.path.isdir(parent) else None


class Layout:
    """File names under the agent home."""

    def __init__(self, home=None):
        self.home = home or agent_home()
        self.agent_dir = os.path.join(self.home, "agent")
        self.current_link = os.path.join(self.agent_dir, "current.pyz")
        self.heartbeat_config = os.path.join(self.home, "heartbeat.json")
        self.heartbeat_pid = os.path.join(self.home, "heartbeat.pid")
        self.heartbeat_log = os.path.join(self.home, "heartbeat.log")
        self.heartbeat_status = os.path.join(self.home, "heartbeat.status.json")
        self.heartbeat_lock = os.path.join(self.home, "heartbeat.lock")
        self.run_lock = os.path.join(self.home, "heartbeat.run.lock")
        self.autostart_dir = os.path.join(self.home, "autostart.d")
        self.autostart_hook = os.path.join(self.autostart_dir, "heartbeat")

    def heartbeat_files(self):
        return [self.heartbeat_config, self.heartbeat_pid, self.heartbeat_log,
                self.heartbeat_log + ".1", self.heartbeat_status, self.heartbeat_lock,
                self.run_lock]

    def ensure_home(self) -> None:
        os.makedirs(self.home, mode=0o755 if is_root() else 0o700, exist_ok=True)


def atomic_write(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` via a temporary file and rename, with ``mode``."""
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
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


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
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    os.symlink(target, tmp)
    try:
        os.replace(tmp, link)
    except BaseException:
        os.unlink(tmp)
        raise
    _fsync_dir(directory)
    return True


def _fsync_dir(directory: str) -> None:
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
