"""How a person reaches a cluster that runs: what the Connect card, ``connection`` in the API and the
certificates for node logins share.

``connection_of(cluster)`` is the cluster's nodes and commands once every machine is Up, or
``NotConnectable`` with the sentence the card shows while it waits ("Waiting for lab-b to be Up").
``node_login_certificate(...)`` signs a certificate for a person's key that opens every node of the
cluster, or one node (machines/ssh_certificates.py does the signing and keeps the record).
The texts and commands themselves are clusters/connection_texts.py's (pure); this module adds the
database, the settings (the jump host), the person asking and the choice of nodes.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.core.exceptions import ValidationError

from clusters import connection_texts, node_logins
from clusters.choices import ClusterState, MemberState, Role
from clusters.connection_texts import ClusterNet, Node, NotConnectable, Snippets
from clusters.models import Cluster
from console import roles
from machines import ssh_ca, ssh_certificates, ssh_rules, sshd
from machines.models import UserPublicKey

NAMED_AT_MOST = 3  # machines named in the waiting sentence; the rest are counted
# Not running, nothing to reach: the sentence names the cluster's state rather than each machine's.
RESTING = {ClusterState.STOPPED, ClusterState.STOPPING, ClusterState.DELETING, ClusterState.UNCONFIRMED}


def ssh_jump() -> str:
    """The ProxyJump every ssh_command goes through: FADEN_SSH_JUMP when people's computers do not
    reach the machines themselves (FADEN_MACHINES_REACHABLE false), else none."""
    return "" if settings.FADEN_MACHINES_REACHABLE else settings.FADEN_SSH_JUMP


def validity_words(seconds: int | None = None) -> str:
    """How long a certificate is valid, in words: "an hour", "30 minutes", "2 hours"."""
    seconds = settings.FADEN_SSH_CERT_SECONDS if seconds is None else seconds
    if seconds % 3600 == 0:
        return "an hour" if seconds == 3600 else f"{seconds // 3600} hours"
    return f"{round(seconds / 60)} minutes"


@dataclass(frozen=True)
class ConnectionInfo:
    """A running cluster as a person reaches it: its nodes by rank, the launchers' view of it, the
    commands, and each node's machine id (for the principals of a certificate)."""

    cluster: Cluster
    nodes: tuple[Node, ...]
    net: ClusterNet
    snippets: Snippets
    jump: str
    machine_ids: dict[str, int]  # machine name -> id
    host_keys: dict[str, str]  # machine name -> its host key's fingerprint, as the console trusts it

    def node(self, wanted) -> Node:
        """The node named ``wanted``: ``node-1``, its rank (1 or "1") or its machine's name (lab-b)."""
        text = str(wanted).strip()
        for node in self.nodes:
            if text in (node.name, str(node.rank), node.machine):
                return node
        last = self.nodes[-1].name
        raise ValidationError({"node": (f"{self.cluster.name} has no node {text or '(empty)'}: its nodes are node-0"
                                        f"{' to ' + last if last != 'node-0' else ''}, by name, rank or machine.")})

    def as_dict(self) -> dict:
        """``connection`` in the API: the nodes with their ssh_command, and every command."""
        return {
            "network": self.net.network,
            "head_address": self.net.head_address,
            "master_port": self.net.master_port,
            "jump": self.jump,
            "hostfile": connection_texts.HOSTFILE_PATH,
            "env_file": connection_texts.ENV_PATH,
            "nodes": [self.node_dict(n) for n in self.nodes],
            "snippets": self.snippets.as_dict(),
        }

    def node_dict(self, node: Node) -> dict:
        """One node as the API gives it: its place, where ssh reaches it, and its ssh_command."""
        return {
            "rank": node.rank, "name": node.name, "machine": node.machine, "machine_id": self.machine_ids[node.machine],
            "address": node.address, "interface": node.interface, "gpus": node.gpus, "free_gpus": list(node.free_gpus),
            "vendor": node.vendor,
            "ssh_user": connection_texts.NODE_LOGIN_USER, "ssh_address": node.ssh_address, "ssh_port": node.ssh_port,
            "host_key_fingerprint": self.host_keys.get(node.machine, ""),
            "ssh_command": self.snippets.ssh_commands[node.name],
        }


def waiting_for(cluster: Cluster, members: list[tuple[str, str, str]]) -> str:
    """Why the cluster cannot be reached yet, or "" once it runs and every machine is Up.
    ``members``: (machine name, role, state) of each, as ``connection_of`` reads them."""
    if not members:
        return f"{cluster.name} has no machines."
    if cluster.state in RESTING:
        return (f"{cluster.name} is {cluster.get_state_display().lower()}: the nodes and their commands appear once it"
                f" runs and every machine is Up.")
    ordered = sorted(members, key=lambda m: (m[1] != Role.HEAD, m[0]))
    waiting = [(name, state) for name, _role, state in ordered if state != MemberState.JOINED]
    if len(waiting) == 1:
        name, state = waiting[0]
        label = MemberState(state).label
        doing = "it did not join" if state == MemberState.FAILED else f"it is {label[0].lower()}{label[1:]}"
        return f"Waiting for {name} to be Up: {doing}."
    if waiting:
        waiting = [name for name, _state in waiting]
        named = waiting[:NAMED_AT_MOST]
        if len(waiting) > NAMED_AT_MOST:
            names = f"{', '.join(named)} and {len(waiting) - NAMED_AT_MOST} more"
        else:
            names = " and ".join([", ".join(named[:-1]), named[-1]]) if len(named) > 1 else named[0]
        return f"Waiting for {names} to be Up."
    if cluster.state != ClusterState.RUNNING:
        return f"Waiting for {cluster.name} to be Running: it is {cluster.get_state_display()}."
    return ""


def connection_of(cluster: Cluster) -> ConnectionInfo:
    """The cluster's nodes and commands, with the jump host of the settings; ``NotConnectable`` with
    the sentence to show while a machine is not Up, the cluster does not run, or a member has no
    address on the cluster network yet. Four queries."""
    members = list(cluster.members.values_list("machine__name", "role", "state", "machine_id", "machine__host_key_fingerprint"))
    if why := waiting_for(cluster, [m[:3] for m in members]):
        raise NotConnectable(why)
    nodes = tuple(connection_texts.nodes_of(cluster))
    net = ClusterNet.of(cluster.name, cluster.network, nodes)
    jump = ssh_jump()
    return ConnectionInfo(cluster=cluster, nodes=nodes, net=net, snippets=connection_texts.snippets(nodes, net, jump=jump),
                          jump=jump, machine_ids={m[0]: m[3] for m in members}, host_keys={m[0]: m[4] for m in members})


# -- certificates for node logins ------------------------------------------------------------------

NO_KEY_NAMED = "You have no key named {name!r} on your profile: add it there, or paste the public key."
KEY_OR_NAME = "Give public_key (the line of your .pub file) or key (the name of a key on your profile), not both."


def public_key_of(*, user, public_key: str = "", key_name: str = "") -> str:
    """The public key a certificate is for: pasted, or one of ``user``'s keys by its name."""
    if public_key and key_name:
        raise ValidationError({"key": KEY_OR_NAME})
    if not key_name:
        return public_key
    row = UserPublicKey.objects.filter(user=user, name=key_name.strip()).first() if user else None
    if row is None:
        raise ValidationError({"key": NO_KEY_NAMED.format(name=key_name.strip())})
    return row.key


@dataclass(frozen=True)
class NodeLogin:
    """A signed certificate and the nodes it opens."""

    issued: ssh_certificates.Issued
    nodes: tuple[Node, ...]
    reach: ConnectionInfo


def node_login_certificate(*, user, cluster: Cluster, public_key: str = "", key_name: str = "", node=None) -> NodeLogin:
    """Sign a certificate for ``user``'s key (``public_key`` pasted, or ``key_name`` of their profile)
    that opens every node of ``cluster`` (its principal) or, given ``node`` (name, rank or machine),
    that node alone (its machine's).

    The person is asked first (a Viewer reads the rules' sentence whatever they sent and whatever
    the cluster's state), then the key, then the cluster: while not every machine is Up the refusal
    is the card's sentence. Not inside a transaction: the signing is durable."""
    ssh_rules.node_login_offer(role=roles.acting(user), allowed=roles.node_logins_allowed(user)).check()
    public_key = public_key_of(user=user, public_key=public_key, key_name=key_name)
    try:
        ssh_rules.public_key_parse(public_key, ca_fingerprint=ssh_ca.ca_fingerprint())
    except ssh_rules.PublicKeyRefused as refused:
        raise ValidationError({"key" if key_name else "public_key": refused.message}) from None
    try:
        reach = connection_of(cluster)
    except NotConnectable as waiting:
        raise ValidationError(str(waiting)) from None
    one = node not in (None, "")
    nodes = (reach.node(node),) if one else reach.nodes
    principals = sshd.login_principals(cluster_id=cluster.pk,
                                       machine_ids=[reach.machine_ids[n.machine] for n in nodes] if one else None)
    issued = ssh_certificates.certificate_issue(
        user=user, public_key=public_key, cluster=cluster.name, principals=principals,
        on_signed=lambda row: node_logins.node_login_record(cluster=cluster, certificate=row))
    return NodeLogin(issued=issued, nodes=nodes, reach=reach)
