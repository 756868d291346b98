"""The drain's job (kind ``deployment.drain``, one per machine, resumable): make before break.

1. *Tell Ray* (Starting the drain): Ray's drain of the machine's node, asked on the head (``ray drain``), so
   that Ray places nothing new there.
2. *Move the copies* (Moving copies): each copy the plan moves gets its replacement on its target (the plan's
   machines, placed again against what runs now; if the room there is gone, anywhere that has room, or it
   says why not and the copy keeps serving). Once the replacement reads Serving and the gateway has read its
   routes since, the old copy leaves the rotation (Stopping), keeps answering what it holds for
   FADEN_DRAIN_GRACE seconds, and stops. Nothing stops early. A copy not moved after FADEN_DRAIN_STUCK seconds
   is said so on the drain; one whose replacement failed at once, with why (nothing starts that one again).
3. *Stop the copies agreed to*: they read Queued ("stopped by the drain of ...") and start again by themselves
   once a machine has room; their engines stop after the same grace.
4. Drained; with Remove, *Leave Ray and the cluster* (Leaving the cluster): the runtime stops there, the machine
   leaves the cluster's record, and the job LEAVE takes its node settings away and writes the others' again.

Every step is keyed by the copy: the replacement's id is written in the job's params in the transaction that
records it, so a job taken up again after its worker died starts no copy twice.
"""
from __future__ import annotations

import time

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from clusters.choices import Role
from clusters.models import ClusterMember
from console.jobs import JobCancelled, JobContext, JobError
from console.models import Job
from deployments import copy_procs, placement, placement_input, rollout, serving
from deployments.asks import ask_of, port_range
from deployments.choices import HOLDS_ROOM, CopyState, DrainState
from deployments.drain import LEAVE, MOVE, STOP_AGREED, TELL_RAY, copies_on, drain_transition
from deployments.models import Copy, Drain
from machines.agent_client import Agent, AgentError

POLL_SECONDS = 1.0  # how often the replacements are looked at
ROUTES_WAIT = 10.0  # seconds the job waits at most for every gateway process to read its routes again
STOP_ATTEMPTS = 3  # an old copy that does not stop after this many tries fails the job (Stop drain or drain again)
LEAVE_WAIT = 300.0  # seconds the leave waits for another operation on the cluster to end

DRAIN_STOPPED = "stopped by the drain of {machine}"
# A copy the plan stops goes back to the queue from these (one being stopped anyway is left to its own job).
AGREED_STOP_FROM = (CopyState.QUEUED, CopyState.COPYING, CopyState.STARTING, CopyState.SERVING, CopyState.FAILED)


def _params_save(ctx: JobContext) -> None:
    Job.objects.filter(pk=ctx.job.pk).update(params=ctx.job.params)


def _still_draining(ctx: JobContext, drain: Drain) -> Drain:
    """The drain's row as it is now; the job ends (cancelled) once Stop drain took it over."""
    ctx.check_cancel()
    row = Drain.objects.select_related("machine", "cluster").filter(pk=drain.pk).first()
    if row is None or row.state == DrainState.STOPPING:
        raise JobCancelled()
    return row


def drain_run(ctx: JobContext, *, drain_id: int) -> None:
    drain = Drain.objects.select_related("machine", "cluster").filter(pk=drain_id).first()
    if drain is None or drain.state == DrainState.STOPPING:
        return  # stopped before its job ran
    if drain.state != DrainState.LEAVING:
        if TELL_RAY.begin(ctx, f"{drain.machine.name} on the head"):
            _tell_ray(ctx, drain)
        drain_transition(drain, to=DrainState.MOVING, reason="", only_from=[DrainState.STARTING, DrainState.MOVING])
        MOVE.always(ctx)
        _move_all(ctx, drain)
        STOP_AGREED.always(ctx)
        _stop_agreed(ctx, drain)
        drain = _still_draining(ctx, drain)
        left = copies_on(drain.machine, drain.cluster_id).count()
        if left:  # copies placed there meanwhile (a health check's restart, say): moved on the next round
            raise JobError(f"{left} cop{'ies' if left != 1 else 'y'} still on {drain.machine.name}: drain it again.")
        drain_transition(drain, to=DrainState.DRAINED, reason=f"{drain.machine.name} runs nothing and takes nothing new.",
                         only_from=[DrainState.MOVING, DrainState.DRAINED])
        if not drain.remove:
            return
        drain_transition(drain, to=DrainState.LEAVING, reason=f"{drain.machine.name} leaves Ray and {drain.cluster.name}.",
                         only_from=[DrainState.DRAINED])
    LEAVE.always(ctx, f"{drain.machine.name} leaves {drain.cluster.name}")
    _leave(ctx, drain)


# -- Ray -------------------------------------------------------------------------------------------


def _tell_ray(ctx: JobContext, drain: Drain) -> None:
    """Ray's drain of the node, on the head. Ray refusing (the node left it already) is said, not fatal: the
    console's own placement keeps new copies off the machine whatever Ray says."""
    cluster = drain.cluster
    member = ClusterMember.objects.filter(cluster=cluster, machine=drain.machine).first()
    head = ClusterMember.objects.select_related("machine").filter(cluster=cluster, role=Role.HEAD).first()
    if member is None or head is None or not member.ray_node_id:
        ctx.detail(f"Ray does not know {drain.machine.name}'s node: nothing to tell")
        return
    try:
        with Agent.open(head.machine) as agent:
            accepted, refusal = agent.ray_drain(head=f"{head.address}:{cluster.ray_port}", node_id=member.ray_node_id,
                                                reason=f"Fadenstack drains {drain.machine.name}")
    except AgentError as exc:
        ctx.log(f"Ray was not told of the drain ({exc.message.rstrip('.')}): the console keeps new copies off "
                f"{drain.machine.name} all the same.")
        ctx.detail("Not told: see the log")
        return
    ctx.detail("Ray places nothing new there" if accepted else f"Ray refused: {refusal}")
    if not accepted:
        ctx.log(f"Ray refused the drain of {drain.machine.name}: {refusal}")


# -- moves -----------------------------------------------------------------------------------------


def _wanted_moves(drain: Drain) -> list[dict]:
    """The plan's moves, and a move anywhere for each copy on the machine the plan does not name (placed there
    since the plan was read): nothing stays behind."""
    moves = list(drain.plan.get("moves", []))
    named = {m["copy"] for m in moves} | {s["copy"] for s in drain.plan.get("stops", [])}
    for pk in copies_on(drain.machine, drain.cluster_id).exclude(pk__in=named).order_by("pk").values_list("pk", flat=True):
        moves.append({"copy": pk, "to": None, "slots": []})
    return moves


def _move_all(ctx: JobContext, drain: Drain) -> None:
    """Every move until each old copy has stopped (or gone by itself); the replacements start together."""
    moved: dict = ctx.job.params.setdefault("moved", {})  # str(old copy id) -> its replacement's id
    since: dict[int, float] = {}
    handed: dict[int, int] = {}  # old copy id -> how often it was found still stopping
    failed: dict[int, str] = {}  # old copy id -> why its replacement failed
    stuck_said: set[int] = set()
    while True:
        drain = _still_draining(ctx, drain)
        ready, waiting, leaving = [], [], []
        for move in _wanted_moves(drain):
            copy = Copy.objects.select_related("deployment__cluster", "deployment__model").filter(pk=move["copy"]).first()
            if copy is None or not copy.placed_on(drain.machine_id) or copy.state not in HOLDS_ROOM | {CopyState.QUEUED}:
                continue  # stopped, moved, or scaled down meanwhile
            if copy.state == CopyState.STOPPING:
                leaving.append(copy)  # out of the rotation already (a job taken up again): its grace, then it stops
                continue
            if copy.state == CopyState.COPYING:
                waiting.append(copy)  # its apply job starts it; then it moves like the others
                since.setdefault(copy.pk, time.monotonic())
                continue
            if copy.state not in (CopyState.SERVING, CopyState.STARTING):
                _unplace(ctx, drain, copy)  # it serves nobody: placed again elsewhere, no handover
                continue
            new_id = moved.get(str(copy.pk))
            new = Copy.objects.filter(pk=new_id).first() if new_id else None
            if new is None or new.state in (CopyState.STOPPING, CopyState.STOPPED):  # none yet, or it went
                new = _replacement_start(ctx, drain, copy, move)
            since.setdefault(copy.pk, time.monotonic())
            if new is not None and new.state == CopyState.SERVING:
                ready.append(copy)
            else:
                waiting.append(copy)
                if new is not None and new.state == CopyState.FAILED and copy.pk not in failed:  # said at once
                    where = _machine_name(new.machine_id)
                    why = (new.state_reason or "see its log").removeprefix(f"{where}: ")
                    failed[copy.pk] = f"#{new.number} on {where}: {why}"
        if ready or leaving:
            for copy in leaving:
                handed[copy.pk] = handed.get(copy.pk, 0) + 1
                if handed[copy.pk] > STOP_ATTEMPTS:
                    raise JobError(f"{copy} did not stop on {drain.machine.name}: {copy.state_reason or 'see the log'}")
            _hand_over(ctx, drain, ready, leaving)
            continue
        if not waiting:
            return
        ctx.detail(f"{len(waiting)} cop{'ies' if len(waiting) != 1 else 'y'} waiting for the replacement to serve")
        stuck = [c for c in waiting if c.pk in failed or time.monotonic() - since[c.pk] > settings.FADEN_DRAIN_STUCK]
        if {c.pk for c in stuck} - stuck_said:
            drain_transition(drain, to=DrainState.MOVING, only_from=[DrainState.MOVING], reason=_stuck_words(stuck, failed))
            stuck_said |= {c.pk for c in stuck}
        time.sleep(POLL_SECONDS)


def _stuck_words(stuck: list[Copy], failed: dict[int, str]) -> str:
    """The drain's reason while copies wait on replacements that failed, or that did not serve in time."""
    said = []
    broken = [c for c in stuck if c.pk in failed]
    if broken:
        said.append(" ".join(f"{c} has not moved: its replacement failed ({failed[c.pk]})." for c in broken))
    late = [c for c in stuck if c.pk not in failed]
    if late:
        said.append(f"{', '.join(str(c) for c in late)} {'have' if len(late) != 1 else 'has'} not moved after "
                    f"{_duration(settings.FADEN_DRAIN_STUCK)}: the replacement did not start.")
    keeps = "They keep" if len(stuck) != 1 else "It keeps"
    return " ".join(said) + f" {keeps} serving here. Read the deployment's errors, or stop the drain."


def _duration(seconds: int) -> str:
    if seconds >= 60 and seconds % 60 == 0:
        minutes = seconds // 60
        return f"{minutes} minute{'s' if minutes != 1 else ''}"
    return f"{seconds} second{'s' if seconds != 1 else ''}"


def _rooms_for(drain: Drain, copy: Copy, move: dict) -> tuple[list, list]:
    """The rooms the plan named for the move (its slots' machines, or its target), and all of the cluster's."""
    rooms = placement_input.cluster_rooms(drain.cluster)
    named = {s["machine"] for s in move.get("slots") or []} or ({move["to"]} if move.get("to") else set())
    return [r for r in rooms if r.id in named], rooms


def _replacement_start(ctx: JobContext, drain: Drain, copy: Copy, move: dict) -> Copy | None:
    """The copy's replacement, recorded (with its id in the job's params, in one transaction) and started by the
    deployment's apply job; None when no machine has room now (the copy keeps serving, and the job says why)."""
    deployment = copy.deployment
    ask = ask_of(deployment, copies=1)
    with transaction.atomic():
        Job.objects.select_for_update(no_key=True).filter(pk=ctx.job.pk).first()  # one recorder at a time
        last = deployment.copy_rows.order_by("-number").values_list("number", flat=True).first() or 0
        wanted = ask.wanted(1, deployment_id=deployment.pk, first=last + 1)
        named, everywhere = _rooms_for(drain, copy, move)
        plan = placement.plan(named, wanted, port_range=port_range()) if named else None
        if plan is None or plan.unplaced:
            plan_anywhere = placement.plan(everywhere, wanted, port_range=port_range())
            if named and not plan_anywhere.unplaced:
                ctx.log(f"The room the plan named for {copy} is taken now: it moves to "
                        f"{_machine_name(plan_anywhere.placed[0].slots[0].machine_id)} instead.")
            plan = plan_anywhere
        if plan.unplaced:
            reason = plan.unplaced[0].reason
            said = ctx.job.params.setdefault("no_room", [])
            if copy.pk not in said:  # said once, not at every look
                said.append(copy.pk)
                _params_save(ctx)
                ctx.log(f"{copy} keeps serving: no machine has room for it now ({reason}).")
            return None
        [new] = rollout.copies_record(deployment, plan, first=last + 1)
        ctx.job.params.setdefault("moved", {})[str(copy.pk)] = new.pk
        _params_save(ctx)
        serving.apply_start(deployment)
    ctx.log(f"Moving {copy} to {_machine_name(new.machine_id)} as #{new.number}")
    new.refresh_from_db()
    return new


def _machine_name(machine_id: int) -> str:
    from machines.models import Machine

    return Machine.objects.filter(pk=machine_id).values_list("name", flat=True).first() or "another machine"


def _unplace(ctx: JobContext, drain: Drain, copy: Copy) -> None:
    """A copy on the machine that serves nobody (queued in its place, failed): its engine, if any, stops and it
    is queued to be placed elsewhere."""
    if copy.state in HOLDS_ROOM:
        copy_procs.stop(copy, _members(drain))
    Copy.objects.filter(pk=copy.pk).update(state=CopyState.QUEUED, machine=None, slots=[], port=None, address=None,
                                           pid=None, state_changed_at=timezone.now(),
                                           state_reason=f"Waiting for its turn to start: moved off {drain.machine.name}.")
    ctx.log(f"{copy} served nobody: queued to start on another machine.")
    serving.queued_woken(drain.cluster_id)
    serving.deployment_changed(copy.deployment_id, drain.cluster_id)


def _members(drain: Drain) -> dict[int, ClusterMember]:
    return {m.machine_id: m for m in ClusterMember.objects.filter(cluster_id=drain.cluster_id).select_related("machine", "cluster")}


def routes_read_since(since: float, *, wait: float = ROUTES_WAIT) -> None:
    """Wait until every gateway process has read the routes after ``since`` (Unix seconds): what was written
    before is what it routes by. Without a gateway (or Redis) to ask, twice its refresh period."""
    from deployments.gateway import traffic

    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        processes = traffic.gateway_processes()
        if not processes:
            time.sleep(2 * settings.FADEN_GATEWAY_REFRESH)
            return
        if all((p.get("routes_read_at") or 0) > since for p in processes):
            return
        time.sleep(min(0.25, settings.FADEN_GATEWAY_REFRESH))


def requests_finished(copy_ids, since: float, *, grace: float) -> float:
    """The grace of copies out of the rotation since ``since`` (Unix seconds): until every gateway process has read
    its routes after that and sends none of them a request any more, ``grace`` seconds at most (all of it when no
    gateway process says). Returns the seconds waited."""
    from deployments.gateway import traffic

    started = time.monotonic()
    ids = {str(pk) for pk in copy_ids}
    while time.monotonic() - started < grace:
        processes = traffic.gateway_processes()
        if processes and all((p.get("routes_read_at") or 0) > since and not ids & set(p.get("leaving") or {})
                             for p in processes):
            break
        time.sleep(0.25)
    return time.monotonic() - started


def _hand_over(ctx: JobContext, drain: Drain, ready: list[Copy], leaving: list[Copy]) -> None:
    """The old copies whose replacement serves leave the rotation once the gateway routes to the replacement;
    the gateway reads that, they finish what they hold (the grace), then stop."""
    if ready:
        moved = ctx.job.params.get("moved", {})
        replacements = {c.pk: c for c in Copy.objects.filter(pk__in=[moved.get(str(c.pk)) for c in ready])}
        since = max((c.serving_since for c in replacements.values() if c.serving_since), default=timezone.now())
        routes_read_since(since.timestamp())  # the gateway read its routes since they serve: they are in the rotation
        for copy in ready:
            new = replacements.get(moved.get(str(copy.pk)))
            serving.copy_transition(copy, to=CopyState.STOPPING, only_from=[CopyState.SERVING, CopyState.STARTING],
                                    reason=f"Moved to #{new.number if new else '?'}: finishing its requests, then it stops.")
            serving.deployment_changed(copy.deployment_id, drain.cluster_id)
    out_at = time.time()
    ctx.detail(f"{len(ready) + len(leaving)} cop{'ies' if len(ready) + len(leaving) != 1 else 'y'} finishing their "
               "requests")
    # Out of the rotation: no new request reaches them; those in flight finish (FADEN_DRAIN_GRACE at most).
    requests_finished([c.pk for c in ready + leaving], out_at, grace=settings.FADEN_DRAIN_GRACE)
    for deployment_id in dict.fromkeys(c.deployment_id for c in ready + leaving):
        deployment = serving.Deployment.objects.select_related("cluster").filter(pk=deployment_id).first()
        if deployment is not None:
            if failures := serving.stops(deployment, grace_over=[c.pk for c in ready + leaving]):
                ctx.log("; ".join(failures))
    for copy in ready + leaving:
        if not Copy.objects.filter(pk=copy.pk).exists():
            ctx.log(f"{copy} stopped on {drain.machine.name}")


# -- stops ------------------------------------------------------------------------------------------


def _stop_agreed(ctx: JobContext, drain: Drain) -> None:
    """The copies the plan stops read Queued with the drain's words (they start again once a machine has room),
    and their engines stop after the grace."""
    stopping: dict = ctx.job.params.setdefault("stopping", {})  # str(copy id) -> where its engine ran
    words = DRAIN_STOPPED.format(machine=drain.machine.name)
    for stop in drain.plan.get("stops", []):
        copy = Copy.objects.filter(pk=stop["copy"]).first()
        if copy is None or not copy.placed_on(drain.machine_id) or str(copy.pk) in stopping:
            continue
        if copy.state == CopyState.STOPPING:
            continue  # stopped anyway (scaled down, deleted): its own job ends it
        with transaction.atomic():
            stopping[str(copy.pk)] = {"machine": copy.machine_id, "slots": copy.slots, "port": copy.port}
            _params_save(ctx)
            Copy.objects.filter(pk=copy.pk, state__in=AGREED_STOP_FROM).update(
                state=CopyState.QUEUED, machine=None, slots=[], port=None,
                                                   address=None, pid=None, state_changed_at=timezone.now(),
                                                   state_reason=f"Waiting for room: {words}.")
        serving.deployment_changed(copy.deployment_id, drain.cluster_id)
    pending = {pk: where for pk, where in stopping.items() if not where.get("done")}
    if not pending:
        ctx.detail("Nothing to stop")
        return
    ctx.detail(f"{len(pending)} cop{'ies' if len(pending) != 1 else 'y'} finishing their requests")
    requests_finished([int(pk) for pk in pending], time.time(), grace=settings.FADEN_DRAIN_GRACE)
    members = _members(drain)
    for pk, where in pending.items():
        copy = Copy.objects.filter(pk=int(pk)).first()
        if copy is None:
            continue
        engine = Copy(pk=copy.pk, deployment_id=copy.deployment_id, number=copy.number, machine_id=where["machine"],
                      slots=where["slots"], port=where["port"])  # the engine as it ran on the drained machine
        if failures := copy_procs.stop(engine, members):
            ctx.log("; ".join(failures))
        where["done"] = True
        _params_save(ctx)
        ctx.log(f"{copy} stopped: it starts again once a machine has room")
    serving.queued_woken(drain.cluster_id)


# -- Remove from cluster -----------------------------------------------------------------------------


def _leave(ctx: JobContext, drain: Drain) -> None:
    """The drained machine leaves: its runtime and Ray stop, it leaves the cluster's record (clusters' Remove,
    which starts the job LEAVE: its node settings go, the others' hostfile, hosts and cluster.env are written
    without it), and the drain's row goes. It stays enrolled."""
    from clusters import services as cluster_services

    machine, cluster = drain.machine, drain.cluster
    if ClusterMember.objects.filter(cluster=cluster, machine=machine).exists():
        try:
            with Agent.open(machine) as agent:
                agent.ray_stop()
                agent.runtime_stop()
        except AgentError as exc:
            ctx.log(f"{machine.name} did not stop its runtime ({exc.message.rstrip('.')}): it is taken out of the "
                    "cluster all the same, and what it holds goes at its next contact.")
        deadline = time.monotonic() + LEAVE_WAIT
        while True:
            try:
                with transaction.atomic():
                    job = cluster_services.cluster_member_remove(cluster=cluster, machine_id=machine.pk, drained=True)
                    Drain.objects.filter(pk=drain.pk).delete()
                break
            except ValidationError as exc:
                if "busy" not in " ".join(exc.messages) or time.monotonic() > deadline:
                    raise JobError(" ".join(exc.messages)) from None
                ctx.detail(" ".join(exc.messages))
                time.sleep(2)
        ctx.log(f"{machine.name} left {cluster.name}: {job.title} clears what it held.")
    else:
        Drain.objects.filter(pk=drain.pk).delete()
    from deployments.drain import drain_changed

    drain_changed(machine.pk, cluster.pk)
    ctx.detail(f"{machine.name} left {cluster.name}; it stays enrolled")
