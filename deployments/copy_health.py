"""The health of each serving copy: looked at with every cluster check, and at once when the gateway
reports one it could not reach. Like the cluster's own repairs it looks twice before it acts: a copy
whose engine has ended is restarted on its machine at the second look (``FADEN_HEALTH_LOOK_AGAIN``
seconds after the first); an engine that still runs but does not answer its health check is looked at
again until it has been silent ``FADEN_COPY_SILENT_GRACE`` seconds (a machine busy for a moment answers
late, and restarting a copy that serves would cost more than the wait), then restarted; a copy whose machine left the cluster (or went offline) is placed elsewhere when there is room,
and waits Queued with the reason when there is not. Each repair is recorded with the cluster's health
checks.
"""
from __future__ import annotations

import logging
from time import time as wall_clock

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from clusters.choices import CheckOutcome, CheckTrigger, MemberState
from clusters.models import ClusterMember, HealthCheck
from console.jobs import task_enqueue
from deployments import copy_procs, engine_metrics, serving
from deployments.choices import CopyState
from deployments.models import Copy
from machines.agent_client import Agent, AgentError
from machines.agent_results import CopyStatus
from machines.choices import MachineState

log = logging.getLogger(__name__)

QUESTION = "copies"
WATCHED = (CopyState.SERVING,)
# Copies of a model running without a deployment are not repaired: nobody deploys it any more (it is taken over
# first, deployments/orphans.py).
OWNED = {"deployment__orphaned_at__isnull": True}


def copies_ask(agent: Agent, member: ClusterMember) -> list[dict] | None:
    """The health check's question to a machine that runs copies: what its agent says of each. The engines of
    the healthy ones are then read for the deployments' charts (engine_metrics.samples_take, which never
    fails the check and takes FADEN_ENGINE_METRICS_TIMEOUT seconds at most)."""
    copies = list(Copy.objects.filter(machine_id=member.machine_id, state__in=WATCHED, **OWNED).select_related("deployment"))
    if not copies:
        return None
    listed = [{"copy": s.copy, "running": s.running, "healthy": s.healthy, "pid": s.pid, "log_tail": s.log_tail}
              for s in agent.copy_list()]
    healthy = {entry["copy"] for entry in listed if entry["healthy"]}
    engine_metrics.samples_take([c for c in copies if c.key in healthy])
    return listed


def copies_checked(cluster, answers: dict) -> None:
    """After a cluster check: copies on a machine that is gone are placed again; copies whose engine did
    not answer are looked at once more, then restarted."""
    members = {m.pk: m for m in cluster.members.select_related("machine")}
    for member_id, answer in answers.items():
        member = members.get(member_id)
        if member is None:
            continue
        watched = list(Copy.objects.filter(machine_id=member.machine_id, deployment__cluster=cluster, state__in=WATCHED, **OWNED)
                       .select_related("deployment", "machine"))
        if not watched:
            continue
        gone = _gone(member)
        if gone:
            for copy in watched:
                copy_placed_again(copy, f"{member.machine.name} {gone}")
            continue
        listed = answer.get(QUESTION)
        if listed is None:
            continue  # not asked, or the agent did not answer: the cluster's own check speaks for the machine
        by_key = {entry["copy"]: entry for entry in listed}
        for copy in watched:
            entry = by_key.get(copy.key)
            if entry is None or not entry.get("healthy"):
                look_again_soon(copy, _words(entry), look=2, unwell_since=wall_clock())


def _gone(member: ClusterMember) -> str | None:
    if member.machine.state == MachineState.OFFLINE:
        return f"is offline ({member.machine.state_reason or 'no heartbeat'})"
    if member.state in (MemberState.DOWN, MemberState.FAILED, MemberState.STOPPED):
        return f"is out of the cluster ({member.state_reason or member.get_state_display()})"
    return None


def _words(entry: dict | None) -> str:
    if entry is None:
        return "Its machine runs no such copy."
    if not entry.get("running"):
        return serving.last_line(entry.get("log_tail") or "") or "Its engine is not running."
    return "Its engine does not answer its health check."


def look_again_soon(copy: Copy, words: str, *, look: int, unwell_since: float) -> None:
    """A look found the copy unwell: the next (number ``look``) comes after the cluster checks' pause."""
    log.info("%s looks unwell (%s): looking again in %s s", copy, words, settings.FADEN_HEALTH_LOOK_AGAIN)
    task_enqueue("deployments.tasks.copy_look", copy.pk, look, unwell_since, countdown=settings.FADEN_HEALTH_LOOK_AGAIN)


def copy_look(copy_id: int, *, look: int = 1, unwell_since: float | None = None) -> str:
    """Ask the copy's machine about it and say what was found. An engine that ended is restarted at the
    second unwell look; one that runs but does not answer, once it has been silent for the grace."""
    copy = Copy.objects.select_related("deployment__cluster", "machine").filter(pk=copy_id, state__in=WATCHED, **OWNED).first()
    if copy is None or copy.machine is None:
        return "not serving any more"
    try:
        with Agent.open(copy.machine) as agent:
            status = next((s for s in agent.copy_list() if s.copy == copy.key), None)
    except AgentError as exc:
        status, unreachable = None, exc.message
    else:
        unreachable = None
    if status is not None and status.healthy:
        return "healthy"
    words = unreachable or _words(_entry(status))
    unwell_since = unwell_since or wall_clock()
    silent = status is not None and status.running  # it runs: only its answer is missing
    if look < 2 or (silent and wall_clock() - unwell_since < settings.FADEN_COPY_SILENT_GRACE):
        look_again_soon(copy, words, look=look + 1, unwell_since=unwell_since)
        return f"unwell ({words}): looking again"
    member = ClusterMember.objects.filter(machine_id=copy.machine_id, cluster=copy.deployment.cluster).select_related("machine").first()
    gone = _gone(member) if member else "is no longer in the cluster"
    if gone:
        copy_placed_again(copy, f"{copy.machine.name} {gone}")
    else:
        copy_restart(copy, words)
    return f"repaired ({words})"


def _entry(status: CopyStatus | None) -> dict | None:
    return None if status is None else {"running": status.running, "healthy": status.healthy, "log_tail": status.log_tail}


def _record(copy: Copy, *, text: str, action: str) -> None:
    now = timezone.now()
    HealthCheck.objects.create(cluster=copy.deployment.cluster, trigger=CheckTrigger.SECOND_LOOK,
                               trigger_detail=f"{copy.deployment.name} #{copy.number}", outcome=CheckOutcome.REPAIR,
                               looked_at=[f"{copy} on {copy.machine.name if copy.machine else '—'}"],
                               found=[{"machine": copy.machine.name if copy.machine else "", "problem": "copy", "text": text}],
                               action=action, finished_at=now)


def copy_restart(copy: Copy, words: str) -> None:
    """Restart the copy where it is: its engine stopped (what is left of it), then started by the apply job."""
    with transaction.atomic():
        if not serving.copy_transition(copy, to=CopyState.FAILED, reason=words, only_from=WATCHED):
            return
        Copy.objects.filter(pk=copy.pk).update(restarts=copy.restarts + 1)
        _record(copy, text=f"{copy}: {words}", action=f"Restarting {copy} on {copy.machine.name} (restart {copy.restarts + 1}).")
    members = {m.machine_id: m for m in copy.deployment.cluster.members.select_related("machine")}
    if failures := copy_procs.stop(copy, members):
        log.warning("%s: its engine could not be stopped before the restart: %s", copy, "; ".join(failures))
    serving.copy_transition(copy, to=CopyState.QUEUED, reason=f"Restarting: {words}")
    serving.apply_start(copy.deployment)
    serving.deployment_changed(copy.deployment)


def copy_placed_again(copy: Copy, why: str) -> None:
    """Its machine is gone: the copy is placed elsewhere when there is room (the apply job plans it)."""
    with transaction.atomic():
        if not serving.copy_transition(copy, to=CopyState.FAILED, reason=why, only_from=WATCHED):
            return
        _record(copy, text=f"{copy}: {why}", action=f"Placing {copy} on another machine of the cluster if one has room.")
        Copy.objects.filter(pk=copy.pk).update(machine=None, slots=[], port=None, address=None, pid=None,
                                               restarts=copy.restarts + 1)
        serving.copy_transition(copy, to=CopyState.QUEUED, reason=f"Waiting to be placed again: {why}.")
    serving.apply_start(copy.deployment)
    serving.deployment_changed(copy.deployment)


def gateway_failures() -> int:
    """The copies the gateway could not reach since the last call: each is looked at at once."""
    from deployments.gateway.failures import failures_take

    seen = set()
    for report in failures_take():
        copy_id = report.get("copy")
        if isinstance(copy_id, int) and copy_id not in seen:
            seen.add(copy_id)
            task_enqueue("deployments.tasks.copy_look", copy_id, 1, None)
    return len(seen)
