"""Pure decisions for creating and starting a cluster: which machines can be picked,
which one leads, which network the cluster uses, and who sends the runtime image to whom.

Plain data in, plain data out: no models, no database, no I/O. The services turn
machines and images into the dataclasses below and act on what comes back.
"""
from __future__ import annotations

import ipaddress
import re
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from machines.runtimes import no_runtime

# ------------------------------------------------------------------ messages

NO_SHARED_NETWORK = "These machines cannot form a cluster yet."
IN_ANOTHER_CLUSTER = "{name} is in the cluster {cluster}: take it out of that cluster before you pick it."
NOT_HEALTHY = "{name} is {state}{reason}"
NO_RUNTIME = "No certified runtime image runs on "  # + "lab-e (AMD Instinct MI300X, x86_64)."
OTHER_ARCH = (
    "{name} is {arch}, the head is {head_arch}: it runs another runtime image, "
    "and no copy of a model spans both kinds."
)
RUNTIME_LABEL = "runs {vendor} {arch} Runtime {major}.x"

HEALTHY = "healthy"
SERVER = "server"  # the source of a transfer that comes from the console itself

# Vendors as people write them; anything else is shown upper-cased.
VENDOR_NAMES = {"nvidia": "NVIDIA", "amd": "AMD", "intel": "Intel"}

# The agent's own rule (agent/fadenstack_agent/parsers.py): names that usually mean a tunnel.
VPN_NAME = re.compile(r"^(wg|tun|tap|tailscale|zt|ppp|ipsec|utun|nebula)", re.IGNORECASE)

RETRY_FIRST_PAUSE = 10
RETRY_LONGEST_PAUSE = 900


# ------------------------------------------------------------------ inputs and outputs

@dataclass(frozen=True)
class Iface:
    """One network interface of a machine, as the agent reported it."""

    name: str
    addresses: tuple[str, ...] = ()  # with prefix: "198.18.1.11/24"
    speed_mbps: int | None = None
    kind: str = "physical"  # physical / bridge / vpn / virtual / loopback
    default_route: bool = False
    management: bool = False


@dataclass(frozen=True)
class Candidate:
    """A machine the wizard may offer, with what the decisions need to know about it."""

    id: Hashable
    name: str
    state: str = HEALTHY
    state_reason: str = ""
    arch: str = ""
    accelerator_vendor: str = ""  # "nvidia", "amd", "" without accelerators
    accelerator_count: int = 0
    accelerator_model: str = ""
    cluster_name: str | None = None
    interfaces: tuple[Iface, ...] = ()
    ssh_address: str = ""  # where the console reaches it: that network carries management traffic
    state_label: str = ""  # the state as the page shows it ("Offline"); the state capitalised if empty
    container_runtime: str = ""  # the runtime in use ("docker", "podman", the lab's "process"); "": none

    @property
    def pickable(self) -> bool:
        """Whether the wizard lets it be ticked at all: a machine without a runtime is not, nor one in
        another cluster or not Healthy (one without a runtime image may be, and blocks Next)."""
        return not self.cluster_name and self.state == HEALTHY and bool(self.container_runtime)


@dataclass(frozen=True)
class ImageBuild:
    id: Hashable
    arch: str
    accelerator_vendor: str
    version: str
    certified: bool = True


@dataclass(frozen=True)
class Verdict:
    selectable: bool
    refusal: str = ""
    warning: str = ""
    runtime_label: str = ""
    runtime: ImageBuild | None = None


@dataclass(frozen=True)
class NetworkMember:
    """One machine's place on a shared network."""

    machine_id: Hashable
    interface: str
    address: str  # without the prefix: "198.18.1.11"
    speed_mbps: int | None


@dataclass(frozen=True)
class SharedNetwork:
    subnet: str  # "198.18.1.0/24": the key for measurements and for Cluster.network
    members: tuple[NetworkMember, ...]
    management: bool = False  # carries a default route or the console's own traffic
    vpn: bool = False  # a tunnel can look like a dedicated link

    @property
    def link_speed_mbps(self) -> int | None:
        """The slowest link on it, which bounds every transfer; None when no machine knows its speed."""
        speeds = [m.speed_mbps for m in self.members if m.speed_mbps]
        return min(speeds) if speeds else None

    def address_of(self, machine_id: Hashable) -> str:
        return next(m.address for m in self.members if m.machine_id == machine_id)


@dataclass(frozen=True)
class Receiver:
    id: Hashable
    platform: str  # "nvidia/x86_64": machines of one platform run one image
    has_image: bool = False


@dataclass(frozen=True)
class Transfer:
    machine_id: Hashable
    source: Hashable  # SERVER, or the id of the machine it fetches from


# ------------------------------------------------------------------ runtime and picking

def version_key(version: str) -> tuple:
    # "2.10.0" is newer than "2.9.1", and a release newer than its "2.1.0rc1".
    key = []
    for part in version.split("."):
        match = re.match(r"(\d*)(.*)", part)
        digits, rest = match.group(1), match.group(2)
        key.append((int(digits) if digits else -1, rest == "", rest))
    return tuple(key)


def runtime_for(candidate: Candidate, builds: Iterable[ImageBuild], major: str = "2") -> ImageBuild | None:
    """The newest certified build of that major version for the candidate's platform, or None."""
    vendor = (candidate.accelerator_vendor or "").lower()
    fitting = [
        b for b in builds
        if b.certified and b.arch == candidate.arch and b.accelerator_vendor.lower() == vendor
        and b.version.split(".")[0] == str(major)
    ]
    return max(fitting, key=lambda b: version_key(b.version), default=None)


def vendor_name(vendor: str) -> str:
    return VENDOR_NAMES.get((vendor or "").lower(), (vendor or "").upper())


def runtime_label(build: ImageBuild, major: str = "2") -> str:
    """``runs NVIDIA x86_64 Runtime 2.x``: what the wizard says beside a machine."""
    return RUNTIME_LABEL.format(vendor=vendor_name(build.accelerator_vendor), arch=build.arch, major=major)


def _sentence(text: str) -> str:
    text = text.strip()
    return text if not text or text[-1] in ".!?" else text + "."


def _kind_of_machine(candidate: Candidate) -> str:
    """``AMD Instinct MI300X, x86_64``: the two things a runtime image is built for."""
    accelerator = candidate.accelerator_model or vendor_name(candidate.accelerator_vendor) or "no accelerators"
    return f"{accelerator}, {candidate.arch or 'unknown architecture'}"


def refusal_for(candidate: Candidate, build: ImageBuild | None) -> str:
    """Why the candidate cannot be picked, in the order a person would fix it; empty when it can."""
    if candidate.cluster_name:
        return IN_ANOTHER_CLUSTER.format(name=candidate.name, cluster=candidate.cluster_name)
    if candidate.state != HEALTHY:
        label = candidate.state_label or candidate.state.replace("_", " ").capitalize()
        reason = ": " + _sentence(candidate.state_reason) if candidate.state_reason.strip() else "."
        return NOT_HEALTHY.format(name=candidate.name, state=label, reason=reason)
    if not candidate.container_runtime:
        return no_runtime(candidate.name)
    if build is None:
        return f"{NO_RUNTIME}{candidate.name} ({_kind_of_machine(candidate)})."
    return ""


def pick_check(
    candidates: Sequence[Candidate], builds: Iterable[ImageBuild], head_id: Hashable = None, major: str = "2"
) -> dict[Hashable, Verdict]:
    """For every candidate: may it be picked, why not, what to warn about, and which runtime it runs."""
    builds = list(builds)
    head = next((c for c in candidates if c.id == head_id), None) if head_id is not None else None
    verdicts = {}
    for candidate in candidates:
        build = runtime_for(candidate, builds, major)
        refusal = refusal_for(candidate, build)
        warning = ""
        # Another architecture is allowed: it runs its own image, and the deployments keep copies apart.
        if head is not None and candidate.id != head.id and candidate.arch != head.arch:
            warning = OTHER_ARCH.format(name=candidate.name, arch=candidate.arch, head_arch=head.arch)
        verdicts[candidate.id] = Verdict(
            selectable=not refusal,
            refusal=refusal,
            warning=warning,
            runtime_label=runtime_label(build, major) if build else "",
            runtime=build,
        )
    return verdicts


def suggest_head(candidates: Iterable[Candidate]) -> Hashable:
    """The machine with the most accelerators; the first by name among equals, so the same every time."""
    best = min(candidates, key=lambda c: (-c.accelerator_count, c.name, str(c.id)), default=None)
    return best.id if best else None


# ------------------------------------------------------------------ networks

def is_vpn_like(iface: Iface) -> bool:
    return iface.kind == "vpn" or bool(VPN_NAME.match(iface.name))


def _ip(text: str):
    """An address with or without a prefix, or None when it is not an address (a host name)."""
    try:
        return ipaddress.ip_interface(text.strip()).ip
    except ValueError:
        return None


def subnets_of(candidate: Candidate):
    """(network, iface, interface address) for every usable address of the machine."""
    for iface in candidate.interfaces:
        if iface.kind == "loopback":
            continue
        for text in iface.addresses:
            try:
                interface = ipaddress.ip_interface(text.strip())
            except ValueError:
                continue  # the agent sent something that is not an address: no network to offer
            if interface.ip.is_loopback or interface.ip.is_link_local:
                continue  # link-local addresses exist on every link, so they say nothing about reachability
            yield interface.network, iface, interface


def shared_networks(candidates: Sequence[Candidate], console_addresses: Iterable[str] = ()) -> list[SharedNetwork]:
    """The subnets on which every candidate has an address, by subnet, each with its marks.

    ``console_addresses`` are the console's own addresses: a subnet holding one carries
    management traffic, like one holding a default route or the address the console uses.
    """
    if not candidates:
        return []
    console_ips = [ip for ip in (_ip(a) for a in console_addresses) if ip is not None]
    per_machine = [list(subnets_of(c)) for c in candidates]
    common = set.intersection(*({network for network, _, _ in entries} for entries in per_machine))
    networks = []
    for network in sorted(common, key=lambda n: (n.version, n)):
        members, management, vpn = [], False, False
        for candidate, entries in zip(candidates, per_machine):
            ssh_ip = _ip(candidate.ssh_address) if candidate.ssh_address else None
            here = [(iface, interface) for net, iface, interface in entries if net == network]
            # A machine with two interfaces on one subnet is listed once: by the first the agent reported.
            iface, interface = here[0]
            members.append(NetworkMember(candidate.id, iface.name, str(interface.ip), iface.speed_mbps))
            for iface, interface in here:
                management |= iface.default_route or iface.management or interface.ip == ssh_ip
                vpn |= is_vpn_like(iface)
        management |= any(ip in network for ip in console_ips)
        networks.append(SharedNetwork(str(network), tuple(members), management, vpn))
    return networks


def _measured(network: SharedNetwork, measured: Mapping[str, float | None]) -> float | None:
    mbps = measured.get(network.subnet)
    return mbps if mbps is not None and mbps > 0 else None  # a failed test carried nothing


def _fastest(networks: list[SharedNetwork], speed) -> SharedNetwork | None:
    scored = [(speed(n), n.subnet, n) for n in networks if speed(n) is not None]
    return min(scored, key=lambda s: (-s[0], s[1]))[2] if scored else None


def suggest_network(networks: Sequence[SharedNetwork], measured: Mapping[str, float | None]) -> str | None:
    """The subnet to suggest: the fastest measured one that carries neither management nor a VPN.

    Without a measurement among those, the fastest of them by link speed. Only when every
    network is management or VPN-like: the fastest measured of those, else the first.
    """
    if not networks:
        return None
    dedicated = [n for n in networks if not n.management and not n.vpn]
    if dedicated:
        choice = _fastest(dedicated, lambda n: _measured(n, measured)) or _fastest(
            dedicated, lambda n: n.link_speed_mbps or 0
        )
    else:
        choice = _fastest(list(networks), lambda n: _measured(n, measured)) or networks[0]
    return choice.subnet


# ------------------------------------------------------------------ moving the runtime image

def distribution_plan(receivers: Sequence[Receiver]) -> list[Transfer]:
    """Who fetches the runtime image from whom, in the order the transfers can start.

    Per platform, machines that already hold the image are the sources. When none does,
    the server sends one copy, to the first machine of that platform (the caller lists
    the head first). Every other machine fetches from the one before it in a chain, so
    each source sends one copy while it still receives its own: about one copy's time
    in all. Several holders start a chain each, and the machines are dealt out between
    them. No machine, nor the server per platform, is the source of more than one transfer.
    """
    seen, tails, plan = set(), {}, []
    holders = {}
    for receiver in receivers:
        if receiver.has_image and receiver.id not in seen:
            holders.setdefault(receiver.platform, []).append(receiver.id)
            seen.add(receiver.id)
    for platform, ids in holders.items():
        tails[platform] = list(ids)  # the end of each chain, next to send
    turn = {}
    for receiver in receivers:
        if receiver.id in seen:
            continue
        seen.add(receiver.id)
        chains = tails.setdefault(receiver.platform, [])
        if not chains:
            plan.append(Transfer(receiver.id, SERVER))
            chains.append(receiver.id)
            continue
        index = turn.get(receiver.platform, 0) % len(chains)
        plan.append(Transfer(receiver.id, chains[index]))
        chains[index] = receiver.id
        turn[receiver.platform] = index + 1
    return plan


def retry_pause(attempt: int) -> int:
    """Seconds to wait before start attempt ``attempt`` + 1: 10, 20, 40, ... and never more than 15 minutes."""
    attempt = max(1, min(attempt, 32))  # 10 * 2**31 is far past the cap already
    return min(RETRY_FIRST_PAUSE * 2 ** (attempt - 1), RETRY_LONGEST_PAUSE)
