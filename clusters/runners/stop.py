"""Stopping a cluster (Ray, the runtime and the file server stop on every machine, freeing the
GPUs) and deleting one (stopped on the machines that answer, then its record goes).

A machine that does not answer cannot confirm it stopped: the cluster then reads Stop not
confirmed, and a person checks the machines and stops or deletes again. Stopping twice is
harmless: every agent command here is a no-op on a machine where nothing runs.
"""
from __future__ import annotations

import time

from django.db import transaction

from clusters import services, steps
from clusters.choices import ClusterState, MemberState
from clusters.fanout import each
from clusters.lifecycle import cluster_transition, member_transition
from clusters.models import Cluster, ClusterMember
from clusters.runners.firewall import firewall_open
from clusters.runners.nodes import node_settings_remove
from clusters.runners.secrets import secrets_remove
from clusters.runners.shared import shared_files_unmount
from clusters.selectors import cluster_members
from console.choices import JOB_ACTIVE
from console.jobs import JobContext, JobError
from console.models import Job
from machines.agent_client import Agent, AgentError
from machines.choices import MachineState

OTHER_JOB_WAIT = 600  # seconds a stop waits for the start it cancelled to reach its next step


def _stop_on(member: ClusterMember) -> str | None:
    """Stop everything the cluster runs on the machine, in one SSH session; the failure in words, or None."""
    machine = member.machine
    if machine.state == MachineState.OFFLINE:
        return f"{machine.name} is offline."
    if not machine.agent_path:
        return f"{machine.name} has no agent."
    try:
        with Agent.open(machine) as agent:
            agent.runtime_stop()
            agent.serve_stop()
    except AgentError as exc:
        return f"{machine.name}: {exc.message.rstrip('.')}."
    member_transition(member, to=MemberState.STOPPED, accelerators_in_ray=0, ray_node_id="")
    return None


def _stop_all(ctx: JobContext, members: list[ClusterMember]) -> list[str]:
    ctx.detail(", ".join(m.machine.name for m in members) or "no machine to stop")
    return each(members, _stop_on)


def _wait_for_other_jobs(ctx: JobContext, cluster: Cluster) -> None:
    """A start or a repair asked to end (Stop wins over it) ends at its next step: wait for that,
    so that it does not start Ray again behind the stop."""
    others = Job.objects.filter(target_type="cluster", target_id=cluster.pk, state__in=JOB_ACTIVE).exclude(pk=ctx.job.pk)
    deadline = time.monotonic() + OTHER_JOB_WAIT
    while others.exists():
        if time.monotonic() > deadline:
            raise JobError(f"{others.first().title} did not end within {OTHER_JOB_WAIT // 60} minutes of being asked to; "
                           "stop the cluster again once it has.")
        ctx.check_cancel()
        time.sleep(0.5)  # polling the other job's row: it ends at its next step


def cluster_stop_run(ctx: JobContext, *, cluster_id: int) -> None:
    cluster = Cluster.objects.get(pk=cluster_id)
    _wait_for_other_jobs(ctx, cluster)
    steps.STOP_ALL.always(ctx)
    failures = _stop_all(ctx, cluster_members(cluster))
    with transaction.atomic():
        cluster.refresh_from_db()
        if failures:
            message = services.cluster_stop_unconfirmed(cluster=cluster, failures=failures)
        else:
            cluster_transition(cluster=cluster, to=ClusterState.STOPPED, reason="")
    if failures:
        raise JobError(message)


def cluster_delete_run(ctx: JobContext, *, cluster_id: int) -> None:
    """Stopped first on every machine that is online (an offline one gets its leftovers replaced the
    next time it starts a cluster), then the node settings go from every machine that answers (the
    log names those that kept them), then the record goes with the cluster's node key."""
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    if cluster is None:
        return  # deleted by an earlier run of this job
    if not ctx.done(steps.STOP_ALL.name):
        _wait_for_other_jobs(ctx, cluster)
        steps.STOP_ALL.always(ctx)
        online = [m for m in cluster_members(cluster) if m.machine.state != MachineState.OFFLINE]
        failures = _stop_all(ctx, online)
        if failures:
            with transaction.atomic():
                cluster.refresh_from_db()
                message = services.cluster_stop_unconfirmed(cluster=cluster, failures=failures)
            raise JobError(message)
    firewall_open(ctx, cluster=cluster.name, machines=[m.machine for m in cluster_members(cluster, status=False)])
    secrets_remove(ctx, cluster=cluster.name, machines=[m.machine for m in cluster_members(cluster, status=False)])
    shared_files_unmount(ctx, cluster)  # before the settings: sshfs logs in with the cluster's own key
    node_settings_remove(ctx, cluster=cluster.name, machines=[m.machine for m in cluster_members(cluster, status=False)])
    steps.DELETE_RECORD.always(ctx)
    with transaction.atomic():
        # The node key is forgotten in the record's transaction: a job taken up again finds nothing left to forget.
        services.cluster_record_delete(cluster=cluster)


def stop_abandoned(job) -> None:
    """The reaper gave up on a stop or a delete: the machines did not confirm."""
    cluster = Cluster.objects.filter(pk=job.target_id).first()
    if cluster is not None and cluster.state in (ClusterState.STOPPING, ClusterState.DELETING):
        services.cluster_stop_unconfirmed(cluster=cluster, failures=[job.error])
