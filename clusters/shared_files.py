"""The cluster's shared files, ``/shared``: which network file system a cluster uses, and the Connect card's
sentence about it. Pure: plain data in, plain data out (clusters/runners/shared.py asks the machines and
records the choice in ``Cluster.shared_files``).

One seam, two methods: NFS from the head where it can export (nfs-kernel-server, with a kernel that has
an NFS server) and every other node can mount NFS (nfs-common); else sshfs over the cluster's own SSH
where every other node has sshfs and FUSE (the lab: its kernel has no NFS server); else none, and the
reason names the machines and what they lack.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

NFS, SSHFS, NONE = "nfs", "sshfs", "none"
SHARED_PATH = "/shared"


@dataclass(frozen=True)
class Abilities:
    """What one machine's ``shared status`` says it can do, and why not where it cannot."""

    can: Mapping[str, bool]  # nfs_export, nfs_mount, sshfs
    cannot: Mapping[str, str] = field(default_factory=dict)

    def able(self, what: str) -> bool:
        return bool(self.can.get(what))

    def why_not(self, what: str) -> str:
        return self.cannot.get(what) or f"it cannot ({what})"


@dataclass(frozen=True)
class SharedChoice:
    """The method, the machines that mount /shared with it, and those left out with why."""

    method: str  # NFS, SSHFS or NONE
    reason: str = ""  # why NONE, in words
    mount_on: tuple[str, ...] = ()  # machine names
    left_out: Mapping[str, str] = field(default_factory=dict)  # machine name -> why it does not mount it

    def as_record(self) -> dict:
        """``Cluster.shared_files``."""
        return {"method": self.method, "reason": self.reason, "left_out": dict(self.left_out)}


def _mount_ability(method: str) -> str:
    return "nfs_mount" if method == NFS else "sshfs"


def _with(method: str, others: Mapping[str, Abilities]) -> SharedChoice:
    need = _mount_ability(method)
    left = {name: a.why_not(need) for name, a in others.items() if not a.able(need)}
    return SharedChoice(method=method, mount_on=tuple(n for n in others if n not in left), left_out=left)


def shared_method(head: str, abilities: Mapping[str, Abilities], *, current: str = "") -> SharedChoice:
    """Choose how ``head`` shares /shared with the other machines of ``abilities`` (by machine name).

    ``current`` is the method the cluster uses already (machines joining a running cluster): it stays
    while the head can still serve it, and a newcomer that cannot mount with it is left out, rather than
    every node being mounted again in another way. Otherwise NFS when the head can export and every other
    machine can mount NFS; else sshfs when every other machine has it; else none, with the reason."""
    others = {name: a for name, a in abilities.items() if name != head}
    head_abilities = abilities[head]
    if current == SSHFS or (current == NFS and head_abilities.able("nfs_export")):
        return _with(current, others)
    if head_abilities.able("nfs_export") and all(a.able("nfs_mount") for a in others.values()):
        return _with(NFS, others)
    if all(a.able("sshfs") for a in others.values()):
        return _with(SSHFS, others)
    lacking = [f"{name} ({a.why_not('sshfs')})" for name, a in others.items() if not a.able("sshfs")]
    nfs = (f"{head} cannot export NFS ({head_abilities.why_not('nfs_export')})" if not head_abilities.able("nfs_export")
           else "not every node can mount NFS")
    return SharedChoice(method=NONE, reason=f"{nfs}, and {', '.join(lacking)} cannot mount sshfs.",
                        left_out={name: "no method works on every node" for name in others})


def shared_sentence(shared_files: Mapping, *, head_node: str, node_of: Mapping[str, str], nodes: int) -> str:
    """The Connect card's words for ``Cluster.shared_files``: "/shared on node-0, mounted on every node with
    sshfs."; "" before the cluster first shared it. ``node_of`` names each machine's node."""
    method = shared_files.get("method")
    if not method:
        return ""
    where = f"{SHARED_PATH} on {head_node}"
    if method == NONE:
        return f"{where} only, not shared with the other nodes: {shared_files.get('reason') or 'no method works here.'}"
    if nodes <= 1:
        return f"{where}, the only node (shared with {method} when machines join)."
    left = shared_files.get("left_out") or {}
    if not left:
        return f"{where}, mounted on every node with {method}."
    missing = "; ".join(f"{node_of.get(machine, machine)} ({machine}: {why.rstrip('.')})" for machine, why in sorted(left.items()))
    return f"{where}, mounted on the other nodes with {method}, but not on {missing}."
