"""The node settings on a cluster's machines (``node files write|remove``, docs/agent-protocol.md): the
hostfile, ``cluster.env`` and the ``/etc/hosts`` lines, the cluster's own SSH key between its nodes,
and sshd's trust in the console's certificate authority (clusters/node_files.py builds them).

Once Ray is up (a start, machines joining, a repair) every member in Ray is written again: a join
changes every node's hostfile and hosts, and each node's known_hosts holds every node's host key, so
the keys are gathered from all of them first. The machines that leave (all of them when the cluster
is deleted) have theirs taken away. A stop keeps them: the cluster and its nodes stay what they were.
Writing the same spec twice changes nothing and reloads nothing, so a job taken up again after its
worker died runs these steps again from the start.
"""
from __future__ import annotations

from collections.abc import Sequence

from clusters import steps
from clusters.choices import MemberState, Role
from clusters.connection_texts import NotConnectable
from clusters.fanout import Outcome, on_every_agent
from clusters.models import Cluster, ClusterMember, NodeSettingsOwed
from clusters.node_files import NodeFilesError, node_files_specs
from clusters.selectors import cluster_members
from console.choices import ErrorKind
from console.jobs import JobContext, JobError, Step
from machines.agent_results import NodeFilesChange
from machines.choices import MachineState
from machines.models import Machine
from machines.versions import agent_outdated

NODE_FILES_AGENT = "0.7.0"  # the first agent with node files write|remove

def _plural(names: list[str], one: str, many: str) -> str:
    return one if len(names) == 1 else many


def _outdated_sentence(old: list[ClusterMember]) -> str:
    names = [f"{m.machine.name} ({m.machine.agent_version or 'unknown'})" for m in old]
    return (f"The node settings need agent {NODE_FILES_AGENT} or newer; {', '.join(names)} "
            f"{_plural(names, 'runs an older one and was', 'run an older one and were')} left out: select Update agent "
            f"on {_plural(names, 'its page', 'their pages')}, and the settings are written at the cluster's next start "
            "or when a machine joins it.")


def _sort_out(members: list[ClusterMember], outcomes: dict[int, Outcome], ctx: JobContext) -> list[ClusterMember]:
    """The members that answered. A worker that does not answer is left out, and the log says so (it
    gets its settings when it joins again); any other failure, or the head not answering, fails the
    step with the agent's own words and the machine's name (every such machine's, in one sentence)."""
    answered, failures, kinds = [], [], set()
    for member in members:
        _, error = outcomes[member.machine_id]
        if error is None:
            answered.append(member)
        elif error.kind == ErrorKind.UNREACHABLE and member.role != Role.HEAD:
            ctx.log(f"{member.machine.name} did not answer ({error.message.rstrip('.')}): "
                    "its node settings are written when it joins again.")
        else:
            failures.append(f"{member.machine.name}: {error.message}")
            kinds.add(str(error.kind))
    if failures:
        raise JobError(" ".join(failures), kind=ErrorKind.NOT_RETRYABLE if ErrorKind.NOT_RETRYABLE in kinds else ErrorKind.RETRYABLE)
    return answered


def node_settings_write(ctx: JobContext, cluster: Cluster, *, step: Step = steps.WRITE_SETTINGS,
                        stopped_too: bool = False) -> None:
    """The step WRITE_SETTINGS: every member in Ray gets its node settings, with every node's host key
    (each checked against its machine's pinned fingerprint). Members not in Ray, and members whose agent
    is older than NODE_FILES_AGENT, are left out with a sentence in the job's log. ``stopped_too``: a
    stopped cluster's members that answer are written too (the node key rotated after a machine left)."""
    step.always(ctx)
    members = cluster_members(cluster, status=False)
    joined = (lambda m: m.machine.state != MachineState.OFFLINE) if stopped_too else (lambda m: m.state == MemberState.JOINED)
    up = [m for m in members if joined(m)]
    down = [m.machine.name for m in members if not joined(m)]
    if down:
        ctx.log(f"{', '.join(down)} {_plural(down, 'is', 'are')} not in Ray: the node settings are written "
                f"on {_plural(down, 'it', 'them')} when {_plural(down, 'it joins', 'they join')} again.")
    old = [m for m in up if agent_outdated(m.machine.agent_version, NODE_FILES_AGENT)]
    if old:
        ctx.log(_outdated_sentence(old))
    # An older agent cannot write, but its machine's host key still goes into the others' known_hosts.
    keys = on_every_agent([m.machine for m in up], lambda agent: agent.host_key())
    answered = _sort_out(up, keys, ctx)
    try:
        specs = node_files_specs(cluster, host_keys={m.machine.name: keys[m.machine_id][0] for m in answered})
    except (NotConnectable, NodeFilesError) as exc:
        raise JobError(str(exc), kind=ErrorKind.NOT_RETRYABLE) from None
    writable = [m for m in answered if m not in old]
    ctx.detail(f"Writing on {len(writable)} of {len(members)} machine(s)")
    written = on_every_agent([m.machine for m in writable], lambda agent: agent.node_files_write(specs[agent.machine.name]))
    done = _sort_out(writable, written, ctx)
    for member in done:
        change: NodeFilesChange = written[member.machine_id][0]
        if change.include_added:
            ctx.log(f"{member.machine.name}: its sshd configuration did not include the console's drop-in; an Include was added.")
        for warning in change.warnings:
            ctx.log(f"{member.machine.name}: {warning}")
    left_out = [m.machine.name for m in members if m not in done]
    ctx.detail(f"Written on {len(done)} of {len(members)} machine(s)"
               + (f"; not on {', '.join(left_out)}" if left_out else ""))


def node_settings_remove(ctx: JobContext, *, cluster: str, machines: Sequence[Machine]) -> list[str]:
    """The step REMOVE_SETTINGS: the machines that leave ``cluster`` (a name: the record may be going)
    have their node settings taken away. It never fails: a machine that is offline or refuses keeps
    them, and the job's log says which, and how to take them away by hand; those sentences are returned.
    Machines whose agent is older than NODE_FILES_AGENT never had any."""
    steps.REMOVE_SETTINGS.always(ctx, ", ".join(m.name for m in machines))
    had = [m for m in machines if m.agent_path and not agent_outdated(m.agent_version, NODE_FILES_AGENT)]
    reachable = [m for m in had if m.state != MachineState.OFFLINE]
    outcomes = on_every_agent(reachable, lambda agent: agent.node_files_remove())
    left: list[str] = []
    kept: list[str] = []
    for machine in had:
        _, error = outcomes.get(machine.pk, (None, None))
        if machine.state == MachineState.OFFLINE:
            why = "it is offline"
        elif error is not None:
            why = error.message.rstrip(".")
        else:
            continue
        kept.append(machine.name)
        owe_removal(machine, cluster=cluster, why=why)
        left.append(f"{machine.name} kept the node settings of {cluster} ({why}): they are replaced when it joins another "
                    f"cluster; to take them away now, run {machine.python_path or 'python3'} {machine.agent_path} "
                    "node files remove on it as root.")
    for sentence in left:
        ctx.log(sentence)
    ctx.detail(f"Removed from {len(had) - len(kept)} of {len(had)} machine(s)"
               + (f"; left behind on {', '.join(kept)}" if kept else ""))
    return left


def owe_removal(machine: Machine, *, cluster: str, why: str = "", shared: bool = True) -> None:
    """Record that ``machine`` still holds ``cluster``'s node settings (and its /shared mount): taken away at its
    next contact (clusters/node_leave.py)."""
    NodeSettingsOwed.objects.update_or_create(machine=machine, defaults={"cluster_name": cluster, "shared": shared,
                                                                         "last_error": why[:2000]})


def node_settings_leave(ctx: JobContext, *, cluster: Cluster, leaving: Sequence[Machine]) -> None:
    """The hook for the job that takes machines out of a running cluster, called once they left its
    record: their settings go, and every member left is written again (its hostfile and hosts no
    longer name them). Nothing calls it yet: today a machine leaves a running cluster only when it
    never joined (``services.cluster_member_remove``, synchronous, reaching no machine), and the drain
    that takes out a machine in Ray (docs/architecture.md, "Drains and removal") is still to come; its
    Operation lists REMOVE_SETTINGS and WRITE_SETTINGS."""
    node_settings_remove(ctx, cluster=cluster.name, machines=leaving)
    if cluster.members.exists():
        node_settings_write(ctx, cluster)
