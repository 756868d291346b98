"""The cluster's own firewall: what each member's nftables table lets in (the agent's ``firewall write``,
docs/network.md "Network and ports").

- Ray's ports: the members' addresses on the cluster's network;
- the copies' ports (``FADEN_COPY_PORTS``): the members, the console and the gateway;
- the file server's port (``transfer.SERVE_PORT``): the members and the console.

The console's addresses are the one each machine sees its SSH session come from (the runner asks each
machine in the session that writes its table) and where this host's routes send its connections to a
member from; the gateway's is the latter (it runs beside the console, as ``faden serve`` starts it).
``FADEN_FIREWALL_ALLOW`` adds addresses or networks the copies' and file servers' ports let in too (a
console behind NAT, a gateway on another host).
"""
from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable, Sequence

from django.conf import settings

from clusters.models import Cluster, ClusterMember
from clusters.transfer import SERVE_PORT
from machines.versions import agent_outdated

FIREWALL_AGENT = "0.10.0"  # the first agent with firewall write|remove|status
DISCARD_PORT = 9  # a UDP "connect" toward it sends nothing: it only asks the kernel for the route's source


class FirewallError(ValueError):
    """The spec cannot be made (an address that is not one): the words say which."""


def source_address(destination: str) -> str:
    """The address this host's connections to ``destination`` leave from (its route's source), or "" when
    there is no route. Nothing is sent: connecting a UDP socket only picks the route."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(destination).version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((destination, DISCARD_PORT))
            return sock.getsockname()[0]
    except (OSError, ValueError):
        return ""


def _addresses(values: Iterable[str], what: str) -> list[str]:
    out: list[str] = []
    for value in values:
        try:
            text = str(ipaddress.ip_network(value.strip(), strict=True))
        except ValueError:
            raise FirewallError(f"{what}: {value!r} is neither an IP address nor a network such as "
                                "10.0.0.0/24.") from None
        text = text.split("/")[0] if text.endswith(("/32", "/128")) else text
        if text not in out:
            out.append(text)
    return out


def firewall_spec(cluster: Cluster, members: Sequence[ClusterMember], *, console: Iterable[str] = ()) -> dict:
    """The spec every member's ``firewall write`` gets: ``members`` are the cluster's members (every one in
    its record, joined or not), ``console`` the addresses the console's sessions come from."""
    member_addresses = _addresses((m.address for m in members if m.address), "a member's address")
    if not member_addresses:
        raise FirewallError(f"{cluster.name} has no member with an address on its network.")
    # This host's own address toward each member: where the gateway's and the console's connections come from.
    gateway = _addresses((a for a in (source_address(m) for m in member_addresses) if a), "the gateway's address")
    allow = _addresses(settings.FADEN_FIREWALL_ALLOW, "FADEN_FIREWALL_ALLOW")
    return {"members": member_addresses,
            "console": _addresses([*console, *gateway, *allow], "the console's address"),
            "gateway": gateway,
            "ports": {"gcs": cluster.ray_port, "copies": list(settings.FADEN_COPY_PORTS), "files": SERVE_PORT}}


def with_console(spec: dict, seen_from: str) -> dict:
    """The spec for one machine: the console's address as that machine sees it added (when it is one)."""
    try:
        extra = _addresses([seen_from], "the console's address") if seen_from else []
    except FirewallError:
        extra = []
    return {**spec, "console": list(dict.fromkeys([*spec["console"], *extra]))}


def outdated(members: Iterable[ClusterMember]) -> list[ClusterMember]:
    """The members whose agent has no firewall commands."""
    return [m for m in members if agent_outdated(m.machine.agent_version, FIREWALL_AGENT)]


def outdated_sentence(old: Sequence[ClusterMember]) -> str:
    names = ", ".join(f"{m.machine.name} ({m.machine.agent_version or 'unknown'})" for m in old)
    one = len(old) == 1
    return (f"The cluster's firewall needs agent {FIREWALL_AGENT} or newer; {names} "
            f"{'runs an older one' if one else 'run older ones'}: "
            f"select Refresh facts on {'its page' if one else 'their pages'} "
            "(it installs this console's agent), then Try again.")
