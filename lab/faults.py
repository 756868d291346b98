"""Faults injected into a running lab: `faden lab fault MACHINE KIND [ARG...]`."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time

from . import hub_host, netns
from . import machine as machines
from .core import is_up, loaded_spec
from .spec import LabSpec, MachineSpec
from .state import LabState
from .util import LabError, UsageError

FILL_FILE = ".fadenstack-lab-disk-full"
# Processes of Ray, for `ray-kill` (a crashed Ray, not a stopped machine).
RAY_MARKERS = ("raylet", "gcs_server", "ray::", "/ray/_private/", "/ray/dashboard/",
               "/ray/autoscaler/", "ray/core/src", "default_worker.py", " ray start")

# kind: (arguments, what it does)
KINDS = {
    "power-off": ("", "kill every process of the machine and take its links down"),
    "power-on": ("", "links up, boot again: init, sshd, /opt/fadenstack/autostart.d"),
    "reboot": ("", "power-off then power-on"),
    "link-down": ("NETWORK", "pull the machine's cable on a network"),
    "link-up": ("NETWORK", "plug it back"),
    "link-slow": ("NETWORK RATE_MBIT", "shape the machine's link on a network to a rate"),
    "link-restore": ("NETWORK", "shape it back to the spec's rate"),
    "sshd-stop": ("", "stop sshd's listener (open sessions go on)"),
    "sshd-start": ("", "start sshd again"),
    "swap-host-key": ("", "a new host key, sshd restarted"),
    "port-taken": ("PORT", "a process listening on the TCP port on all the machine's addresses"),
    "port-free": ("PORT", "end that process"),
    "disk-full": ("", "fill the machine's disk (machines with disk_mib)"),
    "disk-free": ("", "free what disk-full filled"),
    "hub-cut": ("", "cut the machine off from the lab hub (no route to it; the rest is reached)"),
    "hub-restore": ("", "let it reach the lab hub again"),
    "ray-kill": ("", "SIGKILL the machine's Ray processes"),
    "kill-process": ("PATTERN", "SIGKILL the machine's processes whose command line has PATTERN"),
}


def kinds_help() -> str:
    return "\n".join(f"  {kind} {args}".rstrip().ljust(34) + f" {text}"
                     for kind, (args, text) in KINDS.items())


def apply_fault(state: LabState, machine_name: str, kind: str, args: list[str]) -> str:
    """Inject one fault; return a one-line description of what was done."""
    if kind not in KINDS:
        raise UsageError(f"unknown fault {kind!r}; known: {', '.join(KINDS)}")
    expected = KINDS[kind][0].split()
    if len(args) != len(expected):
        usage = f"{kind} {KINDS[kind][0]}".strip()
        raise UsageError(f"fault {kind} takes {len(expected)} argument(s): {usage}")
    with state.locked():
        if not is_up(state):
            raise LabError("the lab is not up: run `faden lab up` first")
        spec = loaded_spec(state)
        try:
            machine = spec.machine(machine_name)
        except KeyError:
            raise UsageError(f"no machine named {machine_name!r}; the lab has "
                             f"{', '.join(m.name for m in spec.machines)}") from None
        fault = Fault(state, spec, machine)
        message = getattr(fault, kind.replace("-", "_"))(*args)
        state.save()
    return f"{machine.name}: {message}"


class Fault:
    def __init__(self, state: LabState, spec: LabSpec, machine: MachineSpec):
        self.state = state
        self.spec = spec
        self.machine = machine
        self.record = state.machine(machine.name)

    # -- helpers -----------------------------------------------------------
    def network(self, name: str):
        if name not in self.machine.networks:
            raise UsageError(f"{self.machine.name} is not on a network named {name!r} "
                             f"(it is on {', '.join(self.machine.networks)})")
        return self.spec.network(name)

    def init_pid(self) -> int:
        if not self.record.get("powered"):
            raise LabError(f"{self.machine.name} is powered off: `power-on` it first")
        pid = self.record.get("init_pid")
        if not pid or not machines.pid_alive(pid):
            raise LabError(f"{self.machine.name}: its init process is gone; power-cycle it")
        return pid

    def port(self, value: str) -> int:
        if not value.isdigit() or not 0 < int(value) < 65536:
            raise UsageError(f"port {value!r} is not a TCP port number")
        return int(value)

    def host_links_up(self, up: bool) -> None:
        down = set(self.record.get("links_down", []))
        for name in self.machine.networks:
            netns.set_link(self.machine.host_link(name), up and name not in down, check=False)

    # -- power -------------------------------------------------------------
    def power_off(self) -> str:
        if not self.record.get("powered"):
            return "already powered off"
        # Links first, so that what the dying processes send never leaves the box.
        self.host_links_up(False)
        for name in self.machine.networks:
            netns.set_link(self.spec.network(name).interface, False,
                           netns=self.machine.netns, check=False)
        netns.kill_netns_processes(self.machine.netns)
        self.record.update(powered=False, init_pid=None, ports_taken={})
        return "powered off"

    def power_on(self) -> str:
        if self.record.get("powered"):
            return "already powered on"
        self.host_links_up(True)
        machines.boot(self.state, self.machine)
        self.record["init_pid"] = machines.wait_booted(self.state, self.spec, self.machine)
        self.record["powered"] = True
        for name in self.machine.networks:
            netns.forget_failed_neighbours(self.spec, self.spec.network(name))
        return "powered on (init, sshd and autostart.d started)"

    def reboot(self) -> str:
        self.power_off()
        self.state.save()
        self.power_on()
        return "rebooted"

    # -- links -------------------------------------------------------------
    def link_down(self, name: str) -> str:
        network = self.network(name)
        down = self.record.setdefault("links_down", [])
        if name not in down:
            down.append(name)
        # The host end goes down: the machine sees NO-CARRIER, as with a pulled cable.
        netns.set_link(self.machine.host_link(network.name), False)
        return f"link on {name} ({network.interface}) is down"

    def link_up(self, name: str) -> str:
        network = self.network(name)
        down = self.record.setdefault("links_down", [])
        if name in down:
            down.remove(name)
        if self.record.get("powered"):
            netns.set_link(self.machine.host_link(network.name), True)
            netns.forget_failed_neighbours(self.spec, network)
        return f"link on {name} ({network.interface}) is up"

    def link_slow(self, name: str, rate: str) -> str:
        network = self.network(name)
        try:
            rate_mbit = float(rate)
        except ValueError:
            raise UsageError(f"rate {rate!r} is not a number of Mbit/s") from None
        if not 0 < rate_mbit <= 100_000:
            raise UsageError(f"rate {rate!r} is out of range (0 < rate <= 100000 Mbit/s)")
        self._shape(network, rate_mbit)
        self.record.setdefault("link_rates", {})[name] = rate_mbit
        return f"link on {name} shaped to {rate_mbit:g} Mbit/s (spec: {network.rate_mbit:g})"

    def link_restore(self, name: str) -> str:
        network = self.network(name)
        self._shape(network, network.rate_mbit)
        self.record.setdefault("link_rates", {}).pop(name, None)
        return f"link on {name} back to {network.rate_mbit:g} Mbit/s"

    def _shape(self, network, rate_mbit: float) -> None:
        netns.shape(self.machine.host_link(network.name), rate_mbit)
        netns.shape(network.interface, rate_mbit, netns=self.machine.netns)

    def hub_cut(self) -> str:
        # A route, not a link: the machine's namespace keeps it across power cycles, like a
        # pulled cable (link-down) stays pulled.
        hub_host.cut(self.spec, self.machine)
        self.record["hub_cut"] = True
        return f"cut off from the lab hub ({self.spec.hub_address}: no route to host)"

    def hub_restore(self) -> str:
        hub_host.restore(self.spec, self.machine)
        self.record["hub_cut"] = False
        return f"reaches the lab hub again ({self.spec.hub_url})"

    # -- sshd --------------------------------------------------------------
    def sshd_stop(self) -> str:
        self.init_pid()
        machines.sshd_stop(self.state, self.machine.name)
        return "sshd stopped"

    def sshd_start(self) -> str:
        machines.sshd_start(self.state, self.machine.name, self.init_pid())
        return "sshd started"

    def swap_host_key(self) -> str:
        process = machines.make_host_key(self.state, self.machine)
        if process.wait() != 0:
            raise LabError(f"ssh-keygen failed: {process.stderr.read().strip()}")
        fingerprint = machines.fingerprint(machines.host_key(self.state, self.machine.name))
        if self.record.get("powered"):
            was_running = machines.sshd_pid(self.state, self.machine.name)
            machines.sshd_stop(self.state, self.machine.name)
            if was_running:
                machines.sshd_start(self.state, self.machine.name, self.init_pid())
        return f"new host key {fingerprint}"

    # -- ports, disk, processes ---------------------------------------------
    def port_taken(self, value: str) -> str:
        port = self.port(value)
        taken = self.record.setdefault("ports_taken", {})
        if str(port) in taken and machines.pid_alive(taken[str(port)]):
            return f"port {port} is already taken"
        command = machines.nsenter_command(self.init_pid(), "/usr/bin/python3", "-c",
                                           PORT_HOLDER, str(port), "fadenstack-lab-port-taken")
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        answer = process.stdout.readline().strip()
        process.stdout.close()
        if answer != "ok":
            process.wait()
            raise LabError(f"could not take port {port}: {answer or 'the holder died'}")
        process.returncode = 0  # it goes on alone; `port-free`, power-off or down end it
        taken[str(port)] = process.pid
        return f"port {port} taken by pid {process.pid}"

    def port_free(self, value: str) -> str:
        port = self.port(value)
        pid = self.record.setdefault("ports_taken", {}).pop(str(port), None)
        if pid is None:
            return f"port {port} was not taken"
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return f"port {port} is free"

    def disk_full(self) -> str:
        path = self._disk()
        fill = os.path.join(path, FILL_FILE)
        fd = os.open(fill, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            stats = os.statvfs(path)
            free = stats.f_bavail * stats.f_frsize
            if free:
                # Reserve the bulk at once, then top up what rounding left.
                with contextlib.suppress(OSError):
                    os.posix_fallocate(fd, os.fstat(fd).st_size, free)
            chunk = b"\0" * (1 << 20)
            while len(chunk) >= 512:
                try:
                    os.write(fd, chunk)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    chunk = chunk[: len(chunk) // 2]
        finally:
            os.close(fd)
        self.record["disk_full"] = True
        stats = os.statvfs(path)
        return f"disk is full ({stats.f_bavail * stats.f_frsize} bytes left)"

    def disk_free(self) -> str:
        path = self._disk()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(path, FILL_FILE))
        self.record["disk_full"] = False
        return "disk is free again"

    def _disk(self) -> str:
        if not self.machine.disk_mib:
            raise UsageError(f"{self.machine.name} has no size-limited disk: "
                             "give it disk_mib in the spec for disk-full")
        return str(machines.store_dir(self.state, self.machine))

    def ray_kill(self) -> str:
        return self._kill(lambda cmdline: any(marker in cmdline for marker in RAY_MARKERS),
                          "Ray")

    def kill_process(self, pattern: str) -> str:
        return self._kill(lambda cmdline: pattern in cmdline, repr(pattern))

    def _kill(self, matches, what: str) -> str:
        init = self.init_pid()
        sshd = machines.sshd_pid(self.state, self.machine.name)
        keep = {init, sshd, os.getpid()}
        victims = [pid for pid, cmdline in machines.processes(netns.netns_pids(self.machine.netns))
                   if pid not in keep and matches(cmdline)]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
        return f"killed {len(victims)} {what} process(es)" if victims else f"no {what} process"


# Listens on a port on every address of the machine until killed.
PORT_HOLDER = """
import os, socket, sys
port = int(sys.argv[1])
server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # like any server: closed connections don't block it
try:
    server.bind(("0.0.0.0", port))
    server.listen(128)
except OSError as exc:
    print(f"{exc.strerror} (port {port})", flush=True)
    sys.exit(1)
print("ok", flush=True)
devnull = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(devnull, fd)
while True:
    connection, _ = server.accept()
    connection.close()
"""
