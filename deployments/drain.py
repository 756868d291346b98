"""Drain a machine, Stop drain, Remove from a running cluster and Cancel removal: the services (the job that
moves the copies is drain_job.py; the plan agreed to comes from the drain plan, as a dict).

A drain is a ``Drain`` row (one per machine) and a job on the machine (kind ``deployment.drain``). Its states,
pushed to the cluster's page, the machine's page and the Machines list: Starting the drain, Moving copies,
Drained; with Remove, Leaving the cluster; with Stop drain, Stopping the drain until the machine is back in Ray.
While the row is there the machine takes no new copy (placement reads it) and a health check does not join it
to Ray again (Ray lets a drained node go: ``hooks.held_out_of_ray``).
"""
from __future__ import annotations

import logging

from django.core.exceptions import ValidationError
from django.db import transaction

from clusters.actions import HEAD_DRAIN
from clusters.choices import ClusterState, Role
from clusters.lifecycle import cluster_changed, cluster_locked
from clusters.models import Cluster, ClusterMember
from console import live, roles
from console.choices import JOB_ACTIVE
from console.jobs import Operation, Step, job_start
from console.lifecycle import InvalidTransition
from console.models import Job
from console.roles import OPERATOR, Action
from deployments.choices import DRAIN_TRANSITIONS, HOLDS_ROOM, CopyState, DrainState
from deployments.models import Copy, Drain
from machines.models import Machine
from machines.versions import agent_outdated

log = logging.getLogger(__name__)

DRAIN_AGENT = "0.11.0"  # the first agent with ``ray drain``
DRAIN = Action("draining a machine", OPERATOR)
REMOVE = Action("removing a machine from a cluster", OPERATOR)

KIND = "deployment.drain"
TELL_RAY = Step("Tell Ray")
MOVE = Step("Move the copies")
STOP_AGREED = Step("Stop the copies agreed to")
LEAVE = Step("Leave Ray and the cluster")
DRAIN_JOB = Operation(KIND, (TELL_RAY, MOVE, STOP_AGREED))
REMOVE_JOB = Operation(KIND, (TELL_RAY, MOVE, STOP_AGREED, LEAVE))

# Drains Ray may have let go of, which a health check leaves out of Ray (Stop drain joins the machine again).
HELD_OUT = frozenset({DrainState.STARTING, DrainState.MOVING, DrainState.DRAINED, DrainState.LEAVING})


# -- pushes and the one guard -----------------------------------------------------------------------


def drain_changed(machine_id: int, cluster_id: int | None) -> None:
    """Push the machine's page, its row of the Machines list, and the cluster's page (after commit)."""
    def push() -> None:
        live.push(f"machine:{machine_id}")
        live.push("machines", part=str(machine_id))
        if cluster_id:
            cluster_changed(cluster_id, part="members")

    transaction.on_commit(push)


def drain_transition(drain: Drain, *, to: str, reason: str = "", only_from=None) -> bool:
    """The one way a drain changes state, checked against DRAIN_TRANSITIONS in the UPDATE itself (a job holding
    an older row cannot write a state the table forbids). Staying in its state only refreshes the reason.
    ``only_from`` narrows who moves: False when the drain was elsewhere (or is gone); without it a move the
    table forbids raises InvalidTransition."""
    from django.utils import timezone

    sources = [s for s, targets in DRAIN_TRANSITIONS.items() if to in targets] + [to]
    allowed = [s for s in sources if only_from is None or s in only_from]
    fields = {"state": to, "state_reason": reason}
    if drain.state != to:
        fields["state_changed_at"] = timezone.now()
    written = Drain.objects.filter(pk=drain.pk, state__in=allowed).update(**fields)
    if not written:
        if only_from is None and Drain.objects.filter(pk=drain.pk).exists():
            current = Drain.objects.get(pk=drain.pk).state
            raise InvalidTransition(f"A drain cannot go from {DrainState(current).label} to {DrainState(to).label}.")
        return False
    for name, value in fields.items():
        setattr(drain, name, value)
    drain_changed(drain.machine_id, drain.cluster_id)
    return True


# -- refusals -----------------------------------------------------------------------------------------


def outdated_for_drain(cluster: Cluster, member: ClusterMember) -> list[str]:
    """The machines a drain of ``member`` needs a newer agent on (the machine and the head), by name."""
    head = cluster.members.select_related("machine").filter(role=Role.HEAD).first()
    machines = [member.machine] + ([head.machine] if head and head.machine_id != member.machine_id else [])
    return [m.name for m in machines if agent_outdated(m.agent_version, DRAIN_AGENT)]


def drain_refusal(cluster: Cluster, member: ClusterMember, *, remove: bool = False) -> str | None:
    """Why ``member`` cannot be drained (or removed by a drain) now, in the product's words; None when it can."""
    name = member.machine.name
    if cluster.state != ClusterState.RUNNING:
        return (f"{cluster.name} is {cluster.get_state_display().lower()}: a machine is drained in a running cluster."
                + (" On a stopped cluster, Remove from cluster only takes it out of the record." if remove else ""))
    if member.role == Role.HEAD:
        if remove:
            return f"{name} leads {cluster.name}: to take out the head, stop the cluster first."
        return HEAD_DRAIN.format(name=name, cluster=cluster.name)
    existing = Drain.objects.filter(machine_id=member.machine_id).first()
    if existing is not None:
        return f"{name} is already {'being removed' if existing.remove else 'draining'}: {existing.get_state_display()}."
    if old := outdated_for_drain(cluster, member):
        return (f"Draining needs agent {DRAIN_AGENT} or newer on the machine and on the head: select Update agent on "
                f"the page of {', '.join(old)}.")
    return None


def _plan_clean(plan, machine: Machine) -> dict:
    """The plan agreed to, checked: every copy it names is one of the machine's, each named once."""
    if not isinstance(plan, dict):
        raise ValidationError({"plan": "The plan must be an object with moves and stops."})
    moves, stops = plan.get("moves", []), plan.get("stops", [])
    if not isinstance(moves, list) or not isinstance(stops, list):
        raise ValidationError({"plan": "The plan's moves and stops must be lists."})
    clean = {"moves": [], "stops": []}
    seen: set[int] = set()
    for entry in moves + stops:
        if not isinstance(entry, dict) or type(entry.get("copy")) is not int:
            raise ValidationError({"plan": "Each move and stop names its copy by id."})
        if entry["copy"] in seen:
            raise ValidationError({"plan": f"Copy {entry['copy']} is named twice in the plan."})
        seen.add(entry["copy"])
    for entry in moves:
        to, slots = entry.get("to"), entry.get("slots", [])
        if type(to) is not int or not isinstance(slots, list) or not all(
                isinstance(s, dict) and type(s.get("machine")) is int for s in slots):
            raise ValidationError({"plan": f"The move of copy {entry['copy']} names no machine to move to."})
        if to == machine.pk or any(s["machine"] == machine.pk for s in slots):
            raise ValidationError({"plan": f"Copy {entry['copy']} cannot move onto {machine.name}, which is drained."})
        clean["moves"].append({"copy": entry["copy"], "to": to, "slots": slots})
    for entry in stops:
        reason = entry.get("reason", "")
        clean["stops"].append({"copy": entry["copy"], "reason": reason if isinstance(reason, str) else ""})
    on_machine = set(copies_on(machine).values_list("pk", flat=True))
    if stray := sorted(seen - on_machine):
        raise ValidationError({"plan": f"The plan names copies that are not on {machine.name}: "
                                       f"{', '.join(map(str, stray))}. Read the plan again."})
    return clean


def copies_on(machine: Machine, cluster_id: int | None = None):
    """The copies that hold room on the machine or are placed there (any of their slots), of any deployment."""
    rows = Copy.objects.filter(state__in=HOLDS_ROOM | {CopyState.QUEUED}).exclude(slots=[])
    if cluster_id is not None:
        rows = rows.filter(deployment__cluster_id=cluster_id)
    ids = [pk for pk, slots, first in rows.values_list("pk", "slots", "machine_id")
           if first == machine.pk or any(s.get("machine") == machine.pk for s in slots or [])]
    return Copy.objects.filter(pk__in=ids)


# -- the services -------------------------------------------------------------------------------------


def drain_start(cluster: Cluster, machine: Machine, plan: dict, *, remove: bool = False, user=None) -> Drain:
    """Drain (or, with ``remove``, Remove from cluster) on a running cluster: the drain's row and its job, which
    moves each copy the plan moves (make before break), stops those it stops, and says Drained (then, removed,
    the machine leaves Ray and the cluster)."""
    (REMOVE if remove else DRAIN).offer(roles.acting(user)).check()
    plan = _plan_clean(plan, machine)
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        member = cluster.members.select_related("machine").filter(machine_id=machine.pk).first()
        if member is None:
            raise ValidationError(f"{machine.name} is not in {cluster.name}.")
        if why := drain_refusal(cluster, member, remove=remove):
            raise ValidationError(why)
        drain = Drain.objects.create(machine=machine, cluster=cluster, remove=remove, plan=plan,
                                     started_by=user if user is not None and user.is_authenticated else None,
                                     state_reason="Ray is told; the plan is checked against what runs now.")
        operation = REMOVE_JOB if remove else DRAIN_JOB
        title = f"Remove {machine.name} from {cluster.name}" if remove else f"Drain {machine.name}"
        drain.job = job_start(kind=KIND, title=title, target_type="machine", target_id=machine.pk,
                              steps=operation.step_names, user=user, params={"drain": drain.pk})
        drain.save(update_fields=["job"])
        drain_changed(machine.pk, cluster.pk)
    log.info("%s: %s by %s (%d moves, %d stops).", cluster.name, title, getattr(user, "username", "the console"),
             len(plan["moves"]), len(plan["stops"]))
    return drain


def machine_remove(cluster: Cluster, machine: Machine, plan: dict | None = None, *, user=None):
    """Remove from cluster: on a running cluster the machine is drained first (``plan`` agreed to), then leaves;
    on a stopped one it only leaves the record (clusters' own Remove). Returns the Drain, or the job LEAVE."""
    from clusters import services as cluster_services

    if cluster.state == ClusterState.RUNNING:
        return drain_start(cluster, machine, plan or {}, remove=True, user=user)
    return cluster_services.cluster_member_remove(cluster=cluster, machine_id=machine.pk, user=user)


def drain_stop(machine: Machine, *, user=None) -> Drain:
    """Stop drain: the drain's job ends; the machine leaves Ray and joins again (Ray has no other way to undo its
    drain), and copies still on it stay there (restarted by the copy checks if the rejoin ended them). The drain's
    row goes once the machine is back in Ray."""
    DRAIN.offer(roles.acting(user)).check()
    from clusters import services as cluster_services

    with transaction.atomic():
        drain = Drain.objects.select_for_update(no_key=True).select_related("cluster", "machine").filter(
            machine_id=machine.pk).first()
        if drain is None:
            raise ValidationError(f"{machine.name} is not draining.")
        if drain.state == DrainState.LEAVING:
            raise ValidationError(f"{machine.name} is leaving {drain.cluster.name} already: the drain can no longer be "
                                  "stopped. Add it to the cluster again once it has left.")
        if drain.state == DrainState.STOPPING:
            return drain
        cluster = cluster_locked(drain.cluster)
        member = cluster.members.filter(machine_id=machine.pk).first()
        Job.objects.filter(pk=drain.job_id, state__in=JOB_ACTIVE).update(cancel_requested=True)
        _copies_back(drain)
        if cluster.state != ClusterState.RUNNING or member is None:
            drain.delete()  # nothing runs: nothing to join again
            drain_changed(machine.pk, cluster.pk)
            return drain
        drain_transition(drain, to=DrainState.STOPPING,
                         reason=f"{machine.name} leaves Ray and joins again; its copies restart there.")
        cluster_services.cluster_rejoin(cluster=cluster, member_ids=[member.pk],
                                        reason=f"Stop drain: {machine.name} leaves Ray and joins again.")
    log.info("%s: the drain of %s stopped by %s.", drain.cluster.name, machine.name, getattr(user, "username", "the console"))
    return drain


def removal_cancel(machine: Machine, *, user=None) -> Drain:
    """Cancel removal, while the machine is still draining: it becomes a Stop drain (the machine stays)."""
    REMOVE.offer(roles.acting(user)).check()
    drain = Drain.objects.filter(machine_id=machine.pk).first()
    if drain is None or not drain.remove:
        raise ValidationError(f"{machine.name} is not being removed.")
    if drain.state == DrainState.LEAVING:
        raise ValidationError(f"{machine.name} is leaving {drain.cluster.name} already: the removal can no longer be "
                              "cancelled.")
    return drain_stop(machine, user=user)


def _copies_back(drain: Drain) -> None:
    """Stop drain: the moves under way end. A copy whose replacement serves already stops (its replacement takes
    its place); a replacement that does not serve yet stops, and its copy stays. Copies still on the machine keep
    their place: their engines do not need the cluster's Ray, and the copy checks restart there any that the
    machine's rejoin ended. The deployments' apply jobs stop what is stopping."""
    from deployments import serving

    moved = (Job.objects.filter(pk=drain.job_id).values_list("params", flat=True).first() or {}).get("moved", {})
    touched = set()
    for copy in copies_on(drain.machine, drain.cluster_id).select_related("deployment"):
        replacement = Copy.objects.filter(pk=moved.get(str(copy.pk)) or 0, state__in=HOLDS_ROOM | {CopyState.QUEUED}).first()
        if replacement is not None and replacement.state == CopyState.SERVING:
            if copy.state != CopyState.STOPPING:
                serving.copy_transition(copy, to=CopyState.STOPPING, reason="Its replacement serves elsewhere.")
            touched.add(copy.deployment)
        elif replacement is not None:
            replacement.deployment = copy.deployment
            serving.copy_stop_begin(replacement)  # the move is off: the copy stays where it was
            touched.add(copy.deployment)
    for deployment in touched:
        serving.apply_start(deployment)
        transaction.on_commit(lambda pk=deployment.pk: serving.deployment_changed(pk, drain.cluster_id))


def drains_back_in_ray(cluster_id: int, machine_ids) -> None:
    """Machines joined Ray again: the drains being stopped there are over (their rows go)."""
    for drain in Drain.objects.filter(cluster_id=cluster_id, machine_id__in=list(machine_ids), state=DrainState.STOPPING):
        drain.delete()
        drain_changed(drain.machine_id, cluster_id)


def drains_cluster_stopping(cluster: Cluster) -> None:
    """The cluster stops under its drains. Their jobs end. A drain still moving copies reads Drained from here:
    nothing runs on the machine once the cluster has stopped, and nothing goes there when it starts again. Its
    copies not moved yet lose their place there (the start places them on other machines, or queues them); one
    whose replacement was placed already leaves it that place. A removal stops being one (on a stopped cluster
    Remove from cluster takes the machine out at once). A drain being stopped is over: the machine joins at the
    next start. A Drained machine stays drained until Stop drain."""
    from django.utils import timezone

    for drain in Drain.objects.select_for_update(no_key=True).select_related("machine").filter(cluster=cluster):
        if drain.state in (DrainState.STARTING, DrainState.MOVING, DrainState.STOPPING):
            Job.objects.filter(pk=drain.job_id, state__in=JOB_ACTIVE).update(cancel_requested=True)
        if drain.state == DrainState.STOPPING:
            drain.delete()
        elif drain.state in (DrainState.STARTING, DrainState.MOVING):
            moved = (Job.objects.filter(pk=drain.job_id).values_list("params", flat=True).first() or {}).get("moved", {})
            for copy in copies_on(drain.machine, cluster.pk):
                if Copy.objects.filter(pk=moved.get(str(copy.pk)) or 0).exclude(state=CopyState.STOPPING).exists():
                    copy.delete()  # its replacement holds its place in the deployment
                else:
                    Copy.objects.filter(pk=copy.pk).update(machine=None, slots=[], port=None, address=None, pid=None,
                                                           state_changed_at=timezone.now())
            words = "left" if drain.remove else "drained"
            reason = (f"{cluster.name} stopped before {drain.machine.name} was {words}: nothing runs on it, and nothing "
                      f"is placed there when the cluster starts again.")
            if drain.remove:
                reason += " Remove from cluster takes it out now that the cluster is stopped."
            Drain.objects.filter(pk=drain.pk).update(remove=False)
            drain_transition(drain, to=DrainState.DRAINED, reason=reason)
        else:
            continue
        drain_changed(drain.machine_id, cluster.pk)


def held_out_of_ray(cluster) -> set[int]:
    """The machines of the cluster Ray may have let go of by a drain: a health check does not join them again."""
    return set(Drain.objects.filter(cluster=cluster, state__in=HELD_OUT).values_list("machine_id", flat=True))


def drain_abandoned(job: Job) -> None:
    """The reaper gave up on the drain's job: the drain says so (Stop drain or a new drain goes on from there)."""
    drain = Drain.objects.filter(pk=(job.params or {}).get("drain")).first()
    if drain is not None and drain.state in (DrainState.STARTING, DrainState.MOVING):
        Drain.objects.filter(pk=drain.pk).update(state_reason=f"The drain's job stopped: {job.error} Stop drain, and "
                                                              "drain again.")
        drain_changed(drain.machine_id, drain.cluster_id)
