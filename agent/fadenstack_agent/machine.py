"""``version`` and ``uninstall``: the agent as installed on this machine."""

import os

from . import get_version, install
from .cli import command
from .files import Layout, store_dir
from .heartbeat import heartbeat_daemon
from .protocol import AgentError


@command("version")
def cmd_version(args, out) -> int:
    """``version``: the agent's version.  Result: ``{"version": "0.3.0"}``."""
    return out.result(version=get_version())


@command("uninstall")
def cmd_uninstall(args, out) -> int:
    """``uninstall``: stop the heartbeat, remove the boot hooks (autostart hook,
    systemd unit), ``<home>/agent`` and the heartbeat files; the store stays.

    Result: ``{"uninstalled": true, "stopped_pid": N | null, "removed":
    [paths], "kept": [store path]}``.  Running it again is a no-op.
    """
    layout = Layout()
    heartbeat = heartbeat_daemon(layout.home)
    stopped = None
    removed = []
    if os.path.isdir(layout.home):
        with heartbeat.control():
            stopped = heartbeat.stop()
            removed = install.remove_installation(layout, out.log, heartbeat.files())
    else:
        removed = install.remove_systemd(layout, out.log)
    try:
        store = store_dir()
    except AgentError:
        store = None
    kept = [store] if store and os.path.isdir(store) else []
    return out.result(uninstalled=True, stopped_pid=stopped, removed=removed, kept=kept)
