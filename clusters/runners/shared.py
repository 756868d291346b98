"""The cluster's shared files on its machines (``shared export|mount|unmount|status``, docs/agent-protocol.md):
``/shared`` on the head, mounted on every other node over the cluster's network with NFS or sshfs
(clusters/shared_files.py chooses from what each machine says it can do).

Once the node settings are written (a start, machines joining, a repair), every member in Ray is asked
what it can do; the head exports (its /shared made, the hostfile copied in), then the others mount it
all at once. The head failing fails the step; a worker that does not answer or cannot mount is left out
with a line in the job's log, and the card says which. The choice is recorded in ``Cluster.shared_files``.
At a delete the mounts go first, then the head's export; the head keeps its files in /shared. Every
command is idempotent (a live mount of the same head changes nothing), so a job taken up again after its
worker died runs the step again.
"""
from __future__ import annotations

import ipaddress

from clusters import steps
from clusters.choices import MemberState, Role
from clusters.fanout import on_every_agent, on_member
from clusters.models import Cluster, ClusterMember
from clusters.selectors import cluster_members
from clusters.shared_files import NONE, Abilities, SharedChoice, shared_method
from console.choices import ErrorKind
from console.jobs import JobContext, JobError
from machines.agent_client import AgentError
from machines.choices import MachineState
from machines.versions import agent_outdated

SHARED_AGENT = "0.8.0"  # the first agent with shared export|mount|unmount|status
# The first agent that exports to the members' addresses (root_squash) and mounts nosuid,nodev; an older
# head exported NFS to the whole subnet, so it gets sshfs (or nothing) until it is updated.
MEMBERS_EXPORT_AGENT = "0.10.0"

def _record(cluster: Cluster, shared_files: dict) -> None:
    """The method the cluster uses, for its Connect card (written only here)."""
    if cluster.shared_files != shared_files:
        cluster.shared_files = shared_files
        Cluster.objects.filter(pk=cluster.pk).update(shared_files=shared_files)


def _words(error: AgentError) -> str:
    return error.message.rstrip(".")


def _usable(ctx: JobContext, members: list[ClusterMember]) -> tuple[list[ClusterMember], dict[str, str]]:
    """The members to share with: in Ray, and with an agent that has the shared commands; the others
    left out with why (a line in the log for each)."""
    usable, left = [], {}
    for member in members:
        name = member.machine.name
        if member.state != MemberState.JOINED:
            left[name] = "not in Ray: it mounts /shared when it joins again"
        elif agent_outdated(member.machine.agent_version, SHARED_AGENT):
            left[name] = (f"its agent {member.machine.agent_version or '(unknown)'} is older than {SHARED_AGENT}: "
                          "select Update agent on its page")
        else:
            usable.append(member)
            continue
        ctx.log(f"{name} does not get /shared ({left[name]}).")
    return usable, left


def _abilities(ctx: JobContext, head: ClusterMember, members: list[ClusterMember],
               left: dict[str, str]) -> dict[str, Abilities]:
    """What each machine can do; a worker that does not answer is left out (the head must answer)."""
    outcomes = on_every_agent([m.machine for m in members], lambda agent: agent.shared_status())
    found = {}
    for member in members:
        status, error = outcomes[member.machine_id]
        if error is None:
            found[member.machine.name] = Abilities(can=status.can, cannot=status.cannot)
            continue
        if member.pk == head.pk:
            raise JobError(f"{head.machine.name}: {error.message}", kind=str(error.kind))
        left[member.machine.name] = f"did not answer ({_words(error)})"
        ctx.log(f"{member.machine.name} did not answer ({_words(error)}): it mounts /shared when it joins again.")
    return found


def export_members(cluster: Cluster) -> list[str]:
    """The addresses the head's NFS export serves: every other member of the record's, one line each."""
    addresses = {ipaddress.ip_address(a) for a in ClusterMember.objects.filter(cluster=cluster).exclude(role=Role.HEAD)
                 .values_list("address", flat=True) if a}
    return [str(a) for a in sorted(addresses, key=lambda a: (a.version, a))]


def shared_files_share(ctx: JobContext, cluster: Cluster, *, keep_method: bool = False) -> SharedChoice | None:
    """The step SHARE_FILES: the head exports /shared and every other member in Ray mounts it. With
    ``keep_method`` (machines joining, a repair) the cluster's method stays while the head can serve it.
    Returns the choice, or None when the head cannot take part (an older agent: said in the log)."""
    steps.SHARE_FILES.always(ctx)
    members = cluster_members(cluster, status=False)
    head = next(m for m in members if m.role == Role.HEAD)
    usable, left = _usable(ctx, members)
    if head not in usable:
        _record(cluster, {"method": NONE, "reason": f"{head.machine.name}, the head: {left[head.machine.name]}.", "left_out": left})
        ctx.detail("Not shared: the head cannot serve /shared")
        return None
    abilities = _abilities(ctx, head, usable, left)
    head_abilities = abilities.get(head.machine.name)
    if head_abilities and head_abilities.able("nfs_export") and agent_outdated(head.machine.agent_version, MEMBERS_EXPORT_AGENT):
        abilities[head.machine.name] = Abilities(
            can={**head_abilities.can, "nfs_export": False},
            cannot={**head_abilities.cannot, "nfs_export": f"its agent {head.machine.agent_version or '(unknown)'} exports "
                                                           f"NFS to the whole subnet: select Update agent on its page"})
    current = cluster.shared_files.get("method", "") if keep_method else ""
    choice = shared_method(head.machine.name, abilities, current=current if current != NONE else "")
    if choice.method == NONE:
        ctx.log(f"/shared stays on {head.machine.name} only: {choice.reason}")
    on_member(head, lambda agent: agent.shared_export(method=choice.method, members=export_members(cluster)))
    by_name = {m.machine.name: m for m in usable}
    mounting = [by_name[name] for name in choice.mount_on]
    outcomes = on_every_agent([m.machine for m in mounting],
                         lambda agent: agent.shared_mount(head=head.address, method=choice.method))
    failed = {}
    for member in mounting:
        _, error = outcomes[member.machine_id]
        if error is not None:
            failed[member.machine.name] = _words(error)
            hint = " (it did not answer)" if error.kind == ErrorKind.UNREACHABLE else ""
            ctx.log(f"{member.machine.name} could not mount /shared from {head.machine.name}{hint}: {_words(error)}.")
    for name, why in choice.left_out.items():
        if choice.method != NONE:
            ctx.log(f"{name} does not mount /shared with {choice.method}: {why}.")
    left_out = {**left, **choice.left_out, **failed}
    _record(cluster, {**choice.as_record(), "left_out": left_out})
    mounted = len(mounting) - len(failed)
    ctx.detail(f"{choice.method}: /shared on {head.machine.name}" + (f", mounted on {mounted} other machine(s)" if mounting else "")
               + (f"; not on {', '.join(sorted(left_out))}" if left_out else ""))
    return choice


def shared_files_unmount(ctx: JobContext, cluster: Cluster) -> list[str]:
    """The step UNMOUNT_SHARED: every node's mount goes, then the head's export (a node's sshfs would
    otherwise hang on a head gone away); the head keeps its files in /shared, and the log says so. It
    never fails: a machine that is offline or refuses keeps its mount, and the log says which and how to
    take it away by hand; those sentences are returned."""
    members = cluster_members(cluster, status=False)
    steps.UNMOUNT_SHARED.always(ctx, ", ".join(m.machine.name for m in members))
    had = [m for m in members if m.machine.agent_path and not agent_outdated(m.machine.agent_version, SHARED_AGENT)]
    reachable = [m for m in had if m.machine.state != MachineState.OFFLINE]
    nodes = [m for m in reachable if m.role != Role.HEAD]
    outcomes = on_every_agent([m.machine for m in nodes], lambda agent: agent.shared_unmount())
    outcomes |= on_every_agent([m.machine for m in reachable if m.role == Role.HEAD], lambda agent: agent.shared_unmount())
    kept: list[str] = []
    for member in had:
        machine = member.machine
        answer, error = outcomes.get(machine.pk, (None, None))
        if machine.state == MachineState.OFFLINE:
            why = "it is offline"
        elif error is not None:
            why = _words(error)
        else:
            if member.role == Role.HEAD:
                ctx.log(f"The head {machine.name} keeps its files in /shared: they stay on that machine until someone "
                        "removes them.")
            for warning in answer.warnings:
                ctx.log(f"{machine.name}: {warning}")
            continue
        kept.append(f"{machine.name} kept /shared as {cluster.name} left it ({why}); to take it away, run "
                    f"{machine.python_path or 'python3'} {machine.agent_path} shared unmount on it as root.")
    for sentence in kept:
        ctx.log(sentence)
    ctx.detail(f"Unmounted on {len(had) - len(kept)} of {len(had)} machine(s)")
    return kept
