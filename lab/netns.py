"""Namespaces, bridges, veth pairs and tc shaping (iproute2 driven)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from .spec import HubSpec, LabSpec, MachineSpec, NetworkSpec
from .state import LabState
from .util import LabError, run

NETNS_DIR = Path("/run/netns")


def ip(*args: str, netns: str | None = None, check: bool = True):
    prefix = ["ip", "-n", netns] if netns else ["ip"]
    return run([*prefix, *args], check=check)


def tc(*args: str, netns: str | None = None, check: bool = True):
    prefix = ["tc", "-n", netns] if netns else ["tc"]
    return run([*prefix, *args], check=check)


def link_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def lab_netns_names() -> list[str]:
    """Every lab namespace on the host (`fl-` prefix), whoever made it."""
    if not NETNS_DIR.is_dir():
        return []
    return sorted(entry.name for entry in NETNS_DIR.iterdir() if entry.name.startswith("fl-"))


def write_sysctl(path: str, value: str) -> None:
    """Best effort: a missing knob (IPv6 disabled at boot) is no reason to fail."""
    with contextlib.suppress(OSError):
        Path(path).write_text(value)


def create_bridge(state: LabState, network: NetworkSpec) -> None:
    """A bridge holding the host's address (.1) on one lab network.

    Forwarding is switched off on the bridge so that, whatever the host's
    ip_forward says, nothing a machine sends is routed out of the lab.
    """
    bridge = network.bridge
    if link_exists(bridge):
        raise LabError(f"a link named {bridge} already exists on the host: "
                       "is another lab up? run `faden lab down --all` first")
    ip("link", "add", bridge, "type", "bridge")
    state.record("bridges", bridge)  # only once made: never remove another lab's
    write_sysctl(f"/proc/sys/net/ipv6/conf/{bridge}/disable_ipv6", "1")
    write_sysctl(f"/proc/sys/net/ipv4/conf/{bridge}/forwarding", "0")
    ip("addr", "add", f"{network.host_address}/{network.subnet.prefixlen}", "dev", bridge)
    ip("link", "set", bridge, "up")


def create_netns(state: LabState, machine: MachineSpec | HubSpec) -> None:
    if netns_exists(machine.netns):
        raise LabError(f"network namespace {machine.netns} already exists: "
                       "is another lab up? run `faden lab down --all` first")
    ip("netns", "add", machine.netns)
    state.record("netns", machine.netns)


def create_machine_link(state: LabState, spec: LabSpec, machine: MachineSpec,
                        network: NetworkSpec) -> None:
    """A veth pair: host end on the network's bridge, machine end in its namespace."""
    create_link(state, machine.netns, machine.host_link(network.name), machine.temp_link(network.name),
                network, spec.address(machine, network.name), network.rate_mbit)


def create_link(state: LabState, namespace: str, host_end: str, temp_end: str, network: NetworkSpec,
                address: str, rate_mbit: float) -> None:
    """A veth pair: ``host_end`` on the network's bridge, the other end in ``namespace`` as the
    network's interface with ``address``; both ends shaped to ``rate_mbit``."""
    if link_exists(host_end) or link_exists(temp_end):
        raise LabError(f"a link named {host_end} already exists on the host: "
                       "run `faden lab down --all` first")
    ip("link", "add", host_end, "type", "veth", "peer", "name", temp_end)
    state.record("links", host_end)
    write_sysctl(f"/proc/sys/net/ipv6/conf/{host_end}/disable_ipv6", "1")
    ip("link", "set", temp_end, "netns", namespace)
    ip("link", "set", temp_end, "name", network.interface, netns=namespace)
    ip("addr", "add", f"{address}/{network.subnet.prefixlen}", "dev", network.interface,
       netns=namespace)
    ip("link", "set", host_end, "master", network.bridge, "up")
    shape(host_end, rate_mbit)
    shape(network.interface, rate_mbit, netns=namespace)


def shape(device: str, rate_mbit: float, netns: str | None = None) -> None:
    """Limit a device's egress with a token bucket (both ends get one: both ways)."""
    bytes_per_second = rate_mbit * 1_000_000 / 8
    # About 4 ms of traffic per burst, never less than a few full-size frames.
    burst = max(32 * 1024, int(bytes_per_second / 250))
    tc("qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{rate_mbit}mbit",
       "burst", str(burst), "latency", "50ms", netns=netns)


def set_link(device: str, up: bool, netns: str | None = None, check: bool = True) -> None:
    ip("link", "set", device, "up" if up else "down", netns=netns, check=check)


def forget_failed_neighbours(spec: LabSpec, network: NetworkSpec) -> None:
    """After a link comes back, drop the ARP failures its absence left behind.

    Otherwise a peer that tried the address while the link was down answers
    "No route to host" for a few seconds more (a real NIC's gratuitous ARP on
    link-up does the same job). Powered-off machines are simply skipped.
    """
    ip("neigh", "flush", "dev", network.bridge, "nud", "failed", "nud", "incomplete", check=False)
    for machine in spec.machines:
        if network.name in machine.networks and netns_exists(machine.netns):
            ip("neigh", "flush", "dev", network.interface, "nud", "failed", "nud", "incomplete",
               netns=machine.netns, check=False)


def netns_pids(name: str) -> list[int]:
    """Processes whose network namespace is this one (all of a machine's)."""
    if not netns_exists(name):
        return []
    result = run(["ip", "netns", "pids", name], check=False)
    return [int(word) for word in result.stdout.split() if word.isdigit()]


def kill_netns_processes(name: str, timeout: float = 10.0) -> None:
    """SIGKILL every process of a namespace until none is left (they fork meanwhile)."""
    deadline = time.monotonic() + timeout
    own = os.getpid()
    while True:
        pids = [pid for pid in netns_pids(name) if pid != own]
        if not pids:
            return
        if time.monotonic() > deadline:
            raise LabError(f"processes {pids} in {name} survive SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def delete_netns(name: str) -> None:
    if netns_exists(name):
        ip("netns", "del", name, check=False)


def delete_link(name: str) -> None:
    if link_exists(name):
        ip("link", "del", name, check=False)
