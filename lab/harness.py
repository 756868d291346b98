"""The lab as the test suite and the benchmarks drive it: one object per state dir that brings the
lab up and down through `python -m lab` (as an operator would), reads its status, injects faults and
undoes them, makes the runtime image files, and opens SSH sessions with the key it was put up with;
and one way to wait for a condition.

Standard library only, like the rest of the lab: the console's side (its key, enrolment, clusters)
is in tests/harness.py, which builds on this.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent
SSH_OPTIONS = ("-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
               "-o", "LogLevel=ERROR")
ANOTHER_LAB = re.compile(r"another lab is up|lab leftovers|already exists on the host")

T = TypeVar("T")


class LabCommandError(RuntimeError):
    """`python -m lab ...` exited non-zero; the message is its one line on stderr."""


class AnotherLabIsUp(LabCommandError):
    """`up` refused: this host holds another lab (one at a time)."""


def wait_until(condition: Callable[[], T], *, timeout: float, what: str, every: float = 0.5,
               meanwhile: Callable[[], str] | None = None) -> T:
    """Ask ``condition`` every ``every`` s until it returns something true, and return that; after
    ``timeout`` s raise TimeoutError naming ``what`` (and what ``meanwhile`` says happened)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            details = f"; meanwhile:\n{meanwhile()}" if meanwhile else ""
            raise TimeoutError(f"waited {timeout:g} s for {what}{details}")
        time.sleep(every)


class Lab:
    """One lab, by its state dir (``$FADEN_LAB_DIR`` of the commands it runs)."""

    def __init__(self, state_dir: str | Path | None = None, *, key: str | Path | None = None):
        self.state_dir = Path(state_dir or tempfile.mkdtemp(prefix="fadenstack-lab-"))
        self.key = Path(key) if key else None  # the private key; its .pub is what `up` authorises
        # The lab belongs to this process: if it dies before taking the lab down, the next `up` may.
        self.env = {**os.environ, "FADEN_LAB_DIR": str(self.state_dir), "FADEN_LAB_AUTHORIZED_KEY": "",
                    "FADEN_LAB_OWNER_PID": str(os.getpid())}
        self.up_seconds: float | None = None  # how long the last `up` that built the lab took

    # -- the command line -------------------------------------------------------------------------
    def run(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        result = subprocess.run([sys.executable, "-m", "lab", *args], cwd=REPO, env=self.env,
                                capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            error = AnotherLabIsUp if args[:1] == ("up",) and ANOTHER_LAB.search(result.stderr) else LabCommandError
            raise error(f"faden lab {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def up(self, spec: str | Path | None = None) -> str:
        """Build the lab (with this key authorised); a lab already up with the same spec and key is kept."""
        args = ["up"] + (["--spec", str(spec)] if spec else [])
        if self.key:
            args += ["--authorized-key", f"{self.key}.pub"]
        started = time.monotonic()
        out = self.run(*args).stdout
        if "already up" not in out:
            self.up_seconds = time.monotonic() - started
        return out

    def down(self) -> str:
        return self.run("down").stdout

    def is_up(self) -> bool:
        return bool(self.status()["up"])

    # -- what it is ---------------------------------------------------------------------------------
    def status(self) -> dict:
        return json.loads(self.run("status", "--json").stdout)

    def machines(self) -> dict[str, dict]:
        """Every machine's status (address, host key fingerprint, powered, faults...), by name."""
        return {m["name"]: m for m in self.status()["machines"]}

    def machine(self, name: str) -> dict:
        return self.machines()[name]

    def images(self, synthetic_mib: int | None = None, out: str | Path | None = None) -> list[Path]:
        """The lab's runtime image files: the real builds, or synthetic ones of ``synthetic_mib`` (kept
        when already there from the same layers)."""
        out = Path(out or self.state_dir / "images")
        size = ["--synthetic-mib", str(synthetic_mib)] if synthetic_mib is not None else []
        made = self.run("images", *size, "--out", str(out)).stdout
        return [Path(line.split()[-1]) for line in made.splitlines() if line.strip().endswith(".img")]

    def runtime(self, runtime: str, *machines: str) -> str:
        """Switch the machines' container runtime: "podman" (as a real machine) or "process"."""
        return self.run("runtime", runtime, *machines).stdout

    # -- faults -------------------------------------------------------------------------------------
    def fault(self, machine: str, *kind: str) -> str:
        return self.run("fault", machine, *kind).stdout

    def heal(self) -> list[str]:
        """Undo every fault the status shows: power on, links up and at their rates, sshd listening,
        ports and disks freed, the lab hub reached again. What it undid, as ``machine: fault`` lines
        (a host key swapped stays swapped)."""
        undone = []
        for name, machine in self.machines().items():
            faults = machine["faults"]
            steps = [] if machine["powered"] else [("power-on",)]
            steps += [("link-up", network) for network in faults["links_down"]]
            steps += [("link-restore", network) for network in faults["link_rates"]]
            steps += [("port-free", str(port)) for port in faults["ports_taken"]]
            steps += [("disk-free",)] if faults["disk_full"] else []
            steps += [("hub-restore",)] if faults.get("hub_cut") else []
            for step in steps:
                self.fault(name, *step)
                undone.append(f"{name}: {' '.join(step)}")
            if machine["powered"] and not machine["sshd_running"]:
                self.fault(name, "sshd-start")
                undone.append(f"{name}: sshd-start")
        return undone

    # -- inside the machines ------------------------------------------------------------------------
    def ssh(self, address: str, command: str, *, timeout: float = 30, connect_timeout: int = 5) -> subprocess.CompletedProcess:
        """Run a shell command on a machine as root, with the lab's key (OpenSSH's client)."""
        if self.key is None:
            raise LabCommandError("this lab was put up without a key of ours: no SSH")
        return subprocess.run(["ssh", "-i", str(self.key), *SSH_OPTIONS, "-o", f"ConnectTimeout={connect_timeout}",
                               f"root@{address}", command], capture_output=True, text=True, timeout=timeout)

    def ssh_argv(self, address: str, command: str) -> list[str]:
        """The same session as an argv, for a caller that keeps it open (Popen)."""
        return ["ssh", "-i", str(self.key), *SSH_OPTIONS, f"root@{address}", command]


def make_key(path: str | Path) -> Path:
    """An ed25519 key pair without a passphrase at ``path`` (and ``path``.pub), unless one is there."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path
