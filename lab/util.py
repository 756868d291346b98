"""Small helpers shared by the lab's modules: errors, running commands."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence

# A clean environment for everything started inside a machine, so that the
# caller's variables (virtualenv, FADEN_LAB_DIR, pytest's) never leak into it.
MACHINE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "USER": "root",
    "LOGNAME": "root",
    "SHELL": "/bin/sh",
}

# Tools `up` needs on the host, with the Debian package that brings each.
REQUIRED_TOOLS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "unshare": "util-linux",
    "nsenter": "util-linux",
    "setsid": "util-linux",
    "mount": "mount",
    "ssh-keygen": "openssh-client",
    "/usr/sbin/sshd": "openssh-server",
}


class LabError(Exception):
    """A failure to report on one line; ``exit_code`` 2 for a bad request."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class UsageError(LabError):
    """The request names something that does not exist (exit code 2)."""

    def __init__(self, message: str):
        super().__init__(message, exit_code=2)


def run(
    cmd: Sequence[str],
    *,
    check: bool = True,
    input: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 60,
) -> subprocess.CompletedProcess:
    """Run a command, capturing its output; raise LabError if it fails and check."""
    try:
        result = subprocess.run(
            list(cmd),
            input=input,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except FileNotFoundError as exc:
        raise LabError(f"{cmd[0]}: command not found") from exc
    except subprocess.TimeoutExpired as exc:
        raise LabError(f"{' '.join(cmd)}: timed out after {timeout:.0f}s") from exc
    if check and result.returncode != 0:
        words = (result.stderr or result.stdout).strip().splitlines()
        reason = words[-1] if words else f"exit status {result.returncode}"
        raise LabError(f"{' '.join(cmd)}: {reason}")
    return result


def missing_host_support() -> str | None:
    """Why this host cannot run the lab, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"the lab needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "the lab needs root (network namespaces, bridges and mounts): run it as root"
    if not os.path.exists("/proc/self/ns/net") or not os.path.exists("/proc/self/ns/mnt"):
        return "this kernel has no network or mount namespaces (/proc/self/ns/net missing)"
    for tool, package in REQUIRED_TOOLS.items():
        found = os.access(tool, os.X_OK) if tool.startswith("/") else shutil.which(tool)
        if not found:
            return f"{tool} is missing: install the {package} package"
    return None


def mount_points() -> list[str]:
    """Every mount point in our mount namespace (os.path.ismount misses bind mounts)."""
    points = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            # Octal escapes (\040 for a space) as the kernel writes them.
            points.append(re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)),
                                 line.split()[4]))
    return points


def is_mount_point(path: str | os.PathLike) -> bool:
    return os.path.abspath(path) in mount_points()
