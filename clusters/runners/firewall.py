"""The cluster's own firewall on its machines (``firewall write|remove``, clusters/firewall.py builds what it
lets in): written before Ray starts on them, written again on every member when a machine joins or leaves,
removed when the cluster is deleted and from a machine that leaves it.

- A start writes it on every machine that loaded the runtime, before the head's Ray starts (the step
  CLOSE_FIREWALL); machines joining get theirs first of all, and the members already in get theirs again
  with the new addresses in, before the newcomers check the way to the head and fetch the image from them
  (a member that does not answer keeps the old table, and the log says so: the next repair writes it);
  a repair writes it on the machines that join again.
- A delete removes it from every machine that answers (the step OPEN_FIREWALL, after Ray stopped); one
  that does not keeps it until it starts another cluster (its write replaces any other cluster's table).
- A machine removed from the record (``services.cluster_member_remove``) loses its table in the job LEAVE,
  with everything else of the cluster's (clusters/node_leave.py); the members left get theirs again without
  it, and a move to another network writes every member's again with the new addresses
  (``firewall_refresh``, a task, for both).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

from clusters import steps
from clusters.fanout import ProgressBoard, missed_by, on_every_agent, on_member, parallel
from clusters.firewall import FIREWALL_AGENT, FirewallError, firewall_spec, outdated, outdated_sentence, with_console
from clusters.models import Cluster, ClusterMember
from clusters.selectors import cluster_members
from console.choices import ErrorKind
from console.jobs import JobContext, JobError
from machines.agent_client import Agent
from machines.choices import MachineState
from machines.models import Machine
from machines.versions import agent_outdated

log = logging.getLogger(__name__)


def _write(agent: Agent, cluster: Cluster, spec: dict):
    return agent.firewall_write(cluster=cluster.name, spec=with_console(spec, agent.ssh_client_address()))


def _spec(cluster: Cluster) -> dict:
    try:
        return firewall_spec(cluster, cluster_members(cluster, status=False))
    except FirewallError as exc:
        raise JobError(str(exc), kind=ErrorKind.NOT_RETRYABLE) from None


def firewall_close(ctx: JobContext, cluster: Cluster, targets: Sequence[ClusterMember], head: ClusterMember,
                   board: ProgressBoard, *, others: Sequence[ClusterMember] = (), tolerate_all: bool = False
                   ) -> list[ClusterMember]:
    """The step CLOSE_FIREWALL: every target gets the cluster's table (each machine's failure as ``parallel``
    takes it: a start fails on the head, a join or a repair only loses that machine), and ``others`` (the
    members already in Ray, when machines join) get theirs again with the new addresses in; one of those
    that fails keeps its table and the log says so. The targets still in are returned. An agent without
    the firewall commands is refused, naming the machines."""
    if not steps.CLOSE_FIREWALL.begin(ctx, f"{len(targets) + len(others)} machine(s)"):
        return list(targets)
    old = outdated([*targets, *others])
    if old:
        raise JobError(outdated_sentence(old), kind=ErrorKind.NOT_RETRYABLE)
    spec = _spec(cluster)
    away = [m for m in others if m.machine.state == MachineState.OFFLINE]
    others = [m for m in others if m not in away]
    if away:
        ctx.log(f"{', '.join(m.machine.name for m in away)} offline: its firewall is written again when it is repaired.")
    outcomes = on_every_agent([m.machine for m in others], lambda agent: _write(agent, cluster, spec))
    for member in others:
        _, error = outcomes[member.machine_id]
        if error is not None:
            ctx.log(f"{member.machine.name} kept its firewall without the new machines ({error.message.rstrip('.')}): "
                    "it gets the new one when it is repaired.")
    kept = parallel(targets, head, board, lambda m, _: on_member(m, lambda agent: _write(agent, cluster, spec)),
                    tolerate_all=tolerate_all)
    ctx.detail(f"Closed on {len(kept) + len(others)} machine(s): Ray's ports let in the cluster's "
               f"{len(spec['members'])} member(s) only")
    return kept


def _remove(cluster: str, machines: Sequence[Machine]) -> tuple[int, list[str]]:
    """Remove the table from ``machines``; how many had theirs removed, and a sentence per machine that kept it."""
    had = [m for m in machines if m.agent_path and not agent_outdated(m.agent_version, FIREWALL_AGENT)]
    kept = [f"{machine.name} kept the firewall of {cluster} ({why}): it goes when the machine starts another "
            f"cluster; to take it away now, run {machine.python_path or 'python3'} {machine.agent_path} "
            f"firewall remove --cluster {cluster} on it as root."
            for machine, why in missed_by(had, lambda agent: agent.firewall_remove(cluster=cluster))]
    return len(had) - len(kept), kept


def firewall_open(ctx: JobContext, *, cluster: str, machines: Sequence[Machine]) -> None:
    """The step OPEN_FIREWALL of a delete: the cluster's table goes from every machine that answers. It never
    fails: a machine that keeps it is named in the log, with how to remove it by hand."""
    steps.OPEN_FIREWALL.always(ctx, ", ".join(m.name for m in machines))
    removed, kept = _remove(cluster, machines)
    for sentence in kept:
        ctx.log(sentence)
    ctx.detail(f"Removed from {removed} machine(s)" + (f"; {len(kept)} kept it" if kept else ""))


def firewall_refresh(*, cluster_id: int) -> list[str]:
    """The members changed outside a job that writes the firewall: a machine left the cluster's record (the
    job LEAVE takes its own table away), or the cluster moved to another network. Every member that answers
    and holds the table gets it again with the members' addresses as they are now (a cluster never started
    has none to change), so that the next start's image transfers between them are let through. What could
    not be done, in sentences (the task logs them)."""
    kept: list[str] = []
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    if cluster is None:
        return kept
    members = [m for m in cluster_members(cluster, status=False)
               if m.machine.state != MachineState.OFFLINE and m.machine.agent_path]
    if not members:
        return kept
    old = outdated(members)
    if old:
        return [*kept, outdated_sentence(old)]
    try:
        spec = firewall_spec(cluster, cluster_members(cluster, status=False))
    except FirewallError as exc:
        return [*kept, str(exc)]

    def rewrite(agent: Agent) -> None:
        if agent.firewall_status(cluster=cluster.name).present:
            _write(agent, cluster, spec)

    outcomes = on_every_agent([m.machine for m in members], rewrite)
    for member in members:
        _, error = outcomes[member.machine_id]
        if error is not None:
            kept.append(f"{member.machine.name} keeps its firewall as it was ({error.message.rstrip('.')}): "
                        "it is written again when it is repaired or the cluster starts.")
    for sentence in kept:
        log.warning("%s", sentence)
    return kept
