"""How the agent stays put on the machine: the ``current.pyz`` link, the boot
hooks (``<home>/autostart.d/heartbeat`` and, on systemd hosts, a unit), how
to start the agent again (``Launch``), and what ``uninstall`` removes."""

import os
import shlex
import shutil
import subprocess
import sys

from . import get_version
from .files import (ENV_HOME, Layout, atomic_symlink, atomic_write, is_system_install, remove_quietly,
                    running_zip, source_root)

SYSTEMD_RUNTIME_DIR = "/run/systemd/system"
SYSTEMD_UNIT_NAME = "fadenstack-heartbeat.service"
SYSTEMD_UNIT_PATH = "/etc/systemd/system/" + SYSTEMD_UNIT_NAME


class Launch:
    """How to run an agent command in a daemon or a boot hook: a python, the
    program (this zip, or the source package), extra environment."""

    def __init__(self, home: str, python=None):
        self.python = python or sys.executable or shutil.which("python3") or "python3"
        self.env = {ENV_HOME: home}
        zipped = running_zip()
        if zipped:
            self.program = [zipped]
            self.boot_program = [Layout(home).current_link]   # boot hooks follow the link
        else:
            self.program = ["-m", "fadenstack_agent"]
            self.boot_program = self.program
            self.env["PYTHONPATH"] = source_root() or ""

    def argv(self, *command) -> list:
        return [self.python] + self.program + list(command)

    def environ(self) -> dict:
        env = dict(os.environ)
        for key, value in self.env.items():
            if key == "PYTHONPATH" and env.get(key):
                value = value + os.pathsep + env[key]
            env[key] = value
        return env


def update_current_link(layout) -> bool:
    """Point ``<home>/agent/current.pyz`` at the running zip (no-op from source)."""
    zipped = running_zip()
    if not zipped:
        return False
    os.makedirs(layout.agent_dir, exist_ok=True)
    return atomic_symlink(zipped, layout.current_link)


def autostart_hook_text(launch, log_path: str) -> str:
    lines = [
        "#!/bin/sh",
        "# Fadenstack heartbeat, written by fadenstack-agent %s; `uninstall` removes it." % get_version(),
        "# Run at boot (every executable in this directory is started, like a systemd unit).",
    ]
    for key in sorted(launch.env):
        lines.append("%s=%s" % (key, shlex.quote(launch.env[key])))
        lines.append("export %s" % key)
    cmd = " ".join(shlex.quote(part) for part in ["python3"] + launch.boot_program + ["heartbeat", "run"])
    log = shlex.quote(log_path)
    lines.append("exec %s </dev/null >>%s 2>&1" % (cmd, log))
    return "\n".join(lines) + "\n"


def install_autostart(layout, launch, log_path: str) -> bool:
    """Write the executable boot hook (``heartbeat run``, output to ``log_path``);
    True when it changed."""
    text = autostart_hook_text(launch, log_path).encode("utf-8")
    try:
        with open(layout.autostart_hook, "rb") as fh:
            if fh.read() == text and os.access(layout.autostart_hook, os.X_OK):
                return False
    except OSError:
        pass
    os.makedirs(layout.autostart_dir, exist_ok=True)
    atomic_write(layout.autostart_hook, text, mode=0o755)
    return True


def systemd_unit_text(launch) -> str:
    exec_start = " ".join(shlex.quote(part) for part in
                          [os.path.abspath(launch.python)] + launch.boot_program + ["heartbeat", "run"])
    env = "\n".join("Environment=%s=%s" % (k, launch.env[k]) for k in sorted(launch.env))
    return (
        "[Unit]\n"
        "Description=Fadenstack heartbeat (fadenstack-agent)\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n\n"
        "[Service]\n"
        "Type=simple\n"
        "%s\n"
        "ExecStart=%s\n"
        "Restart=on-failure\n"
        "RestartSec=10\n\n"
        "[Install]\n"
        "WantedBy=multi-user.target\n" % (env, exec_start)
    )


def _systemctl(*args):
    try:
        proc = subprocess.run(["systemctl"] + list(args), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if proc.returncode != 0:
        return (proc.stderr or proc.stdout).decode("utf-8", "replace").strip() or "exit %d" % proc.returncode
    return None


def systemd_managed(layout) -> bool:
    return is_system_install(layout.home) and os.path.isdir(SYSTEMD_RUNTIME_DIR)


def install_systemd(layout, launch, log) -> bool:
    """Best effort: write and enable the unit on systemd hosts (system install only)."""
    if not systemd_managed(layout):
        return False
    try:
        text = systemd_unit_text(launch).encode("utf-8")
        try:
            with open(SYSTEMD_UNIT_PATH, "rb") as fh:
                same = fh.read() == text
        except OSError:
            same = False
        if not same:
            atomic_write(SYSTEMD_UNIT_PATH, text, mode=0o644)
            problem = _systemctl("daemon-reload")
            if problem:
                log("systemctl daemon-reload failed: %s" % problem)
        problem = _systemctl("enable", SYSTEMD_UNIT_NAME)
        if problem:
            log("systemctl enable %s failed: %s" % (SYSTEMD_UNIT_NAME, problem))
            return False
        return True
    except OSError as exc:
        log("could not install %s: %s" % (SYSTEMD_UNIT_PATH, exc))
        return False


def remove_systemd(layout, log) -> list:
    if not is_system_install(layout.home) or not os.path.exists(SYSTEMD_UNIT_PATH):
        return []
    if os.path.isdir(SYSTEMD_RUNTIME_DIR):
        problem = _systemctl("disable", SYSTEMD_UNIT_NAME)
        if problem:
            log("systemctl disable %s failed: %s" % (SYSTEMD_UNIT_NAME, problem))
    removed = [SYSTEMD_UNIT_PATH] if remove_quietly(SYSTEMD_UNIT_PATH) else []
    if os.path.isdir(SYSTEMD_RUNTIME_DIR):
        _systemctl("daemon-reload")
    return removed


def remove_installation(layout, log, daemon_files=()) -> list:
    """Remove boot hooks, ``<home>/agent`` and ``daemon_files`` (not the store).

    Everything this needs is imported already: ``<home>/agent`` may hold the
    very zip this code runs from.
    """
    removed = []
    if remove_quietly(layout.autostart_hook):
        removed.append(layout.autostart_hook)
    try:
        os.rmdir(layout.autostart_dir)
    except OSError:
        pass
    removed += remove_systemd(layout, log)
    if os.path.lexists(layout.agent_dir):
        shutil.rmtree(layout.agent_dir, ignore_errors=True)
        removed.append(layout.agent_dir)
    for path in daemon_files:
        if remove_quietly(path):
            removed.append(path)
    try:
        os.rmdir(layout.home)     # only when nothing else (e.g. the store) is left
        removed.append(layout.home)
    except OSError:
        pass
    return removed
