"""The small commands: ``version``, ``facts`` and ``uninstall``."""

import os

from . import get_version, install
from .facts import collect_facts
from .heartbeat import _Locked, stop_daemon
from .paths import Layout, store_dir
from .protocol import AgentError


def cmd_version(args, out) -> int:
    """``version``: the agent's version.  Result: ``{"version": "0.1.0"}``."""
    return out.result(version=get_version())


def cmd_facts(args, out) -> int:
    """``facts [--store PATH]``: what this machine is.

    Result: ``{"facts": {"agent_version", "hostname", "arch", "cpu_count",
    "memory_mib", "kernel", "os", "store": {"path", "free_bytes",
    "total_bytes"}, "accelerators": [...], "interfaces": [...],
    "container_runtime": {"name", "version"} | null, "warnings": [...]}}``.
    """
    return out.result(facts=collect_facts(store=args.store))


def cmd_uninstall(args, out) -> int:
    """``uninstall``: stop the heartbeat, remove the boot hooks (autostart hook,
    systemd unit), ``<home>/agent`` and the heartbeat files; the store stays.

    Result: ``{"uninstalled": true, "stopped_pid": N | null, "removed":
    [paths], "kept": [store path]}``.  Running it again is a no-op.
    """
    layout = Layout()
    stopped = None
    removed = []
    if os.path.isdir(layout.home):
        with _Locked(layout):
            stopped = stop_daemon(layout)
            removed = install.remove_installation(layout, out.log)
    else:
        removed = install.remove_systemd(layout, out.log)
    try:
        store = store_dir()
    except AgentError:
        store = None
    kept = [store] if store and os.path.isdir(store) else []
    return out.result(uninstalled=True, stopped_pid=stopped, removed=removed, kept=kept)
