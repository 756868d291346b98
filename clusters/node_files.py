"""What each machine of a cluster is given to be one of its nodes, as the spec the agent's
``node files write`` reads on stdin (docs/agent-protocol.md): the hostfile, its ``cluster.env``
and the ``/etc/hosts`` lines (clusters/connection_texts.py's texts), the cluster's own SSH key between
its nodes with the nodes' host keys, and sshd's trust in the console's certificate authority
(machines/sshd.py's drop-in, machines/ssh_ca.py's public key, the principals root accepts).

``node_files_spec`` is pure: plain data in, the JSON-ready spec out. Around it:

- ``node_key_for(cluster=...)``: the cluster's node key, an Ed25519 key made on first use. Its
  private half is a secret that goes to every node: sealed at rest with console/secrets.py (under
  ``clusters.node_key.<id>``, never in the cluster's row, a log line or an error), its public
  half on the row (``Cluster.node_public_key``). A key that cannot be unsealed any more (the
  secrets' key file was replaced) is replaced by a new one: every member is written again at the
  next start or join, so the nodes move to it together. ``node_key_forget`` goes with the cluster.
- ``node_files_specs(cluster, host_keys=...)``: every member's spec, read from the database.

Host keys: the console holds each machine's pinned fingerprint, not its key. The runner that
writes the files has a connection to every member open anyway, whose host key ``remote.connect``
checked against that pin: ``Agent.host_key()`` gives it as a line, and ``host_key_line`` checks it
once more against the pin before it goes into every node's known_hosts. Without them the nodes
record each other's keys at their first connection (``StrictHostKeyChecking accept-new``).
"""
from __future__ import annotations

import base64
import binascii
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import load_ssh_private_key
from django.db import transaction
from django.views.decorators.debug import sensitive_variables

from clusters import connection_texts, node_logins
from clusters.connection_texts import ClusterNet, Node
from clusters.models import Cluster, ClusterMember
from console import secrets
from machines import ssh_ca, ssh_krl, ssh_rules, sshd

log = logging.getLogger(__name__)

SECRET_PREFIX = "clusters.node_key."
HOST_KEY_KINDS = ssh_rules.ACCEPTED_KINDS  # what sshd offers as host keys, RSA of any size included


class NodeFilesError(ValueError):
    """A spec that cannot be built: the message is the sentence to show."""


@dataclass(frozen=True)
class NodeKey:
    """The cluster's own SSH key between its nodes: ``public_key`` is one ``authorized_keys`` line."""

    public_key: str
    private_key: str = field(repr=False)  # OpenSSH's private key format, no passphrase


def node_key_secret_name(cluster_id: int) -> str:
    return f"{SECRET_PREFIX}{int(cluster_id)}"


@sensitive_variables()
def node_key_make(*, comment: str) -> NodeKey:
    """A new Ed25519 key pair; ``comment`` ends the public line (what ``authorized_keys`` shows of it)."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption()).decode("ascii")
    public = private.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return NodeKey(public_key=f"{public.decode('ascii')} {comment}", private_key=pem)


@sensitive_variables()
def _halves_match(private_key: str, public_key: str) -> bool:
    try:
        key = load_ssh_private_key(private_key.encode("ascii"), password=None)
    except (ValueError, TypeError, UnicodeEncodeError):
        return False
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    return public.decode("ascii").split()[:2] == public_key.split()[:2]


@sensitive_variables()
def node_key_for(*, cluster: Cluster) -> NodeKey:
    """The cluster's node key, made and sealed on first use; the row's ``node_public_key`` is its
    public half. Under the cluster's row lock, so two members' runners make one key between them."""
    name = node_key_secret_name(cluster.pk)
    with transaction.atomic():
        row = Cluster.objects.select_for_update(no_key=True).only("pk", "name", "node_public_key").get(pk=cluster.pk)
        private = secrets.secret_get(name)
        if private and row.node_public_key and _halves_match(private, row.node_public_key):
            key = NodeKey(public_key=row.node_public_key, private_key=private)
        else:
            key = node_key_make(comment=f"fadenstack-cluster-{row.name}")
            secrets.secret_set(name, key.private_key)
            row.node_public_key = key.public_key
            row.save(update_fields=["node_public_key"])
            log.info("Made the node key of cluster %s (%s)%s.", row.name, _fingerprint(key.public_key),
                     "" if private is None else ", the one it had did not match its public half")
    cluster.node_public_key = key.public_key
    return key


def node_key_rotate(*, cluster: Cluster) -> NodeKey:
    """A new node key for the cluster (a machine left it with a copy of the old one): the old one is forgotten
    and every member written afterwards gets the new one, which its authorized keys accept instead."""
    with transaction.atomic():
        Cluster.objects.select_for_update(no_key=True).filter(pk=cluster.pk).update(node_public_key="")
        secrets.secret_clear(node_key_secret_name(cluster.pk))
    old = cluster.node_public_key
    key = node_key_for(cluster=cluster)
    log.info("Rotated the node key of cluster %s: %s replaces %s.", cluster.name, _fingerprint(key.public_key),
             _fingerprint(old) if old else "none")
    return key


def node_key_forget(*, cluster: Cluster) -> bool:
    """Forget the cluster's sealed node key (the cluster is deleted); whether there was one."""
    return secrets.secret_clear(node_key_secret_name(cluster.pk))


def _fingerprint(line: str) -> str:
    return ssh_rules.fingerprint_of(base64.b64decode(line.split()[1]))


# ------------------------------------------------------------------ host keys


def host_key_line(line: str, *, machine: str, pinned: str) -> str:
    """A machine's host key as a ``type base64`` line, checked against the fingerprint the console
    pinned for it: a key that is not that one does not go into the nodes' known_hosts."""
    parts = (line or "").split()
    try:
        blob = base64.b64decode(parts[1], validate=True) if len(parts) >= 2 and parts[0] in HOST_KEY_KINDS else b""
    except binascii.Error:
        blob = b""
    if not blob:
        raise NodeFilesError(f"{machine}'s host key is not an OpenSSH public key line: {line[:60]!r}.")
    offered = ssh_rules.fingerprint_of(blob)
    if not pinned or offered != pinned:
        raise NodeFilesError(f"{machine}'s host key {offered} is not the one the console pinned for it "
                             f"({pinned or 'none yet'}): its nodes' known_hosts would trust the wrong machine.")
    return f"{parts[0]} {parts[1]}"


# ------------------------------------------------------------------ the spec


@sensitive_variables("node_key")
def node_files_spec(*, cluster: str, network: str, nodes: Sequence[Node], node: Node, node_key: NodeKey,
                    ca_public_key: str, principals: Sequence[str],
                    host_keys: Mapping[str, Sequence[str]] | None = None, revoked_keys: bytes | None = None) -> dict:
    """The spec of ``node files write`` for ``node``, one of ``nodes``. ``host_keys``: checked key
    lines by machine name (``host_key_line``); a node without any is recorded at its first connection.
    ``principals``: what root on this machine accepts (machines/sshd.py's ``root_principals``).
    ``revoked_keys``: the cluster's key revocation list (clusters/node_logins.py), empty when not given.
    Raises ``connection_texts.NotConnectable`` or ``NodeFilesError`` with the sentence to show."""
    net = ClusterNet.of(cluster, network, nodes)
    ordered = sorted(nodes, key=lambda n: n.rank)
    host_keys = host_keys or {}
    try:
        principals_text = sshd.principals_file_text(list(principals))
    except ValueError as exc:
        raise NodeFilesError(str(exc)) from None
    return {
        "cluster": cluster,
        "hostfile": connection_texts.hostfile(ordered),
        "cluster_env": connection_texts.cluster_env(ordered, node, master_port=net.master_port),
        "hosts": connection_texts.hosts_lines(ordered),
        "ssh": {
            "private_key": node_key.private_key,
            "public_key": node_key.public_key,
            "allow_from": net.network,  # the key opens root's account only to connections from the cluster network
            # Node-to-node SSH goes to the port the console reaches the machine on: one sshd serves both.
            "nodes": [{"name": n.name, "address": n.address, "port": n.ssh_port,
                       "host_keys": list(host_keys.get(n.machine, ()))} for n in ordered],
        },
        "sshd": {"dropin": sshd.sshd_dropin(), "ca_public_key": ca_public_key.strip(), "principals": principals_text,
                 # Written with the drop-in that names it as RevokedKeys (sshd refuses every key without it).
                 "revoked_keys": base64.b64encode(revoked_keys if revoked_keys is not None else
                                                  ssh_krl.krl_bytes(ca_public_key=ca_public_key, version=0, generated_at=0)
                                                  ).decode("ascii")},
    }


def node_files_specs(cluster: Cluster, *, host_keys: Mapping[str, str] | None = None) -> dict[str, dict]:
    """Every member's spec, by machine name, with the cluster's node key (made on first use) and the
    console's certificate authority. ``host_keys``: ``Agent.host_key()`` of members, by machine name,
    each checked against its machine's pinned fingerprint."""
    nodes = connection_texts.nodes_of(cluster)
    machines = {m.machine.name: m.machine for m in ClusterMember.objects.filter(cluster=cluster).select_related("machine")}
    checked = {name: [host_key_line(line, machine=name, pinned=machines[name].host_key_fingerprint)]
               for name, line in (host_keys or {}).items() if name in machines}
    node_key = node_key_for(cluster=cluster)
    ca_public_key = ssh_ca.ca_public_key()
    revoked_keys = node_logins.revocation_list(cluster)
    return {
        n.machine: node_files_spec(
            cluster=cluster.name, network=cluster.network, nodes=nodes, node=n, node_key=node_key,
            ca_public_key=ca_public_key, host_keys=checked, revoked_keys=revoked_keys,
            principals=sshd.root_principals(machine_id=machines[n.machine].pk, cluster_id=cluster.pk))
        for n in nodes
    }
