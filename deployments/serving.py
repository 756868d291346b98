"""Copies running for real: the job that brings a deployment's copies to what is wanted, and their stops.

``deployment.apply`` (a job on the deployment, so the cluster's own actions are never blocked by it):

1. *Copy the model*: the machines of the copies it starts get the model's files first (the chain of
   ``store/machine_files.files_to_members``, or each machine's own download, per the cluster's model source);
2. *Start the copies*: each copy's engine is started by the agent of its (first) machine inside the
   cluster's runtime container, with exactly the GPUs and the port its slots name (``engine.vllm_command``);
   a copy over several machines first gets a Ray of its own on them (``copy_procs``);
3. *Wait until they serve*: a copy reads Serving once its engine answers its health and lists the model
   (the agent asks on the machine: the server may not reach the cluster's network); meanwhile its last log
   lines show, and an engine that exits reads Failed in its own words.

Each copy is claimed by a conditional update (Queued -> Copying the model), so two jobs of one deployment
never start the same copy. Copies being stopped (scaled down, deleted, or with their cluster) are stopped
first. Nothing here restarts a running copy: scaling touches only the difference.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Case, F, Q, QuerySet, Value, When
from django.utils import timezone

from clusters.choices import ClusterState, MemberState
from clusters.fanout import each
from clusters.lifecycle import cluster_changed
from clusters.models import Cluster, ClusterMember
from console import live
from console.choices import JOB_ACTIVE, ErrorKind, JobState
from console.jobs import JobContext, JobError, Operation, Step, job_start
from console.lifecycle import InvalidTransition, sources_of
from console.models import Job
from deployments import copy_keys, copy_procs, copy_tls, engine, placement, placement_input
from deployments.asks import ask_of, port_range, slot_json
from deployments.choices import COPY_TRANSITIONS, HOLDS_ROOM, CopyState, DrainState, ModelState
from deployments.models import Copy, Deployment, ModelHolding
from deployments.store import machine_files
from machines.agent_client import Agent, AgentError

KIND = "deployment.apply"
COPY_FILES = Step("Copy the model")
START = Step("Start the copies")
WAIT = Step("Wait until they serve")
APPLY = Operation(KIND, (COPY_FILES, START, WAIT))

DELETE_KIND = "deployment.delete"
STOP = Step("Stop the copies")
DELETE = Operation(DELETE_KIND, (STOP,))

POLL_SECONDS = 1.0  # how often the machines are asked about starting copies
LOG_LINES = 12


# -- pushes and the one guard ---------------------------------------------------------------------


def deployment_changed(deployment: Deployment | int, cluster_id: int | None = None) -> None:
    """Push the deployment's page, its row of the list, and the cluster page's models card."""
    pk = deployment if isinstance(deployment, int) else deployment.pk
    cluster_id = cluster_id if cluster_id is not None else getattr(deployment, "cluster_id", None)
    live.push(f"deployment:{pk}")
    live.push("deployments", part=str(pk))
    if cluster_id:
        cluster_changed(cluster_id, part="cards")


def copies_transition(copies: QuerySet[Copy], *, to: str, reason: str = "", only_from=None, **fields) -> int:
    """The one way copies change state, one or many: checked against the table in the UPDATE itself (a job
    holding older objects cannot write a state the table forbids). ``only_from`` narrows who moves (the
    others are left as they are, not refused); without it a copy the table does not let go there raises
    InvalidTransition and nothing is written. Returns how many copies were written."""
    rows = copies if only_from is None else copies.filter(state__in=list(only_from))
    if only_from is None:
        refused = rows.exclude(state__in=sources_of(COPY_TRANSITIONS, to)).values_list("deployment__name", "number", "state").first()
        if refused:
            name, number, state = refused
            raise InvalidTransition(f"{name} #{number} cannot go from {CopyState(state).label} to {CopyState(to).label}.")
    # The time it changed moves only for the copies whose state does: a refreshed reason keeps it.
    changed_at = Case(When(~Q(state=to), then=Value(timezone.now())), default=F("state_changed_at"))
    return rows.filter(state__in=sources_of(COPY_TRANSITIONS, to)).update(state=to, state_reason=reason, state_changed_at=changed_at, **fields)


def copy_transition(copy: Copy, *, to: str, reason: str = "", only_from=None, **fields) -> bool:
    """``copies_transition`` for the one copy a caller holds, whose object follows. False when the copy was
    not in a state ``only_from`` allows (or is gone); then nothing is written."""
    if not copies_transition(Copy.objects.filter(pk=copy.pk), to=to, reason=reason, only_from=only_from, **fields):
        return False
    copy.state, copy.state_reason = to, reason
    for name, value in fields.items():
        setattr(copy, name, value)
    return True


# -- starting the job -------------------------------------------------------------------------------


def apply_start(deployment: Deployment, *, user=None) -> Job:
    """Start the apply job; when one is active already, it goes round once more instead (one apply job
    per deployment at a time: it alone claims and starts copies). A job that has said it is closing
    (``closing``, written under the row lock) reads nothing more, so a new one starts then."""
    with transaction.atomic():
        active = (Job.objects.select_for_update(no_key=True).filter(kind=KIND, target_type="deployment", target_id=deployment.pk,
                                                         state__in=JOB_ACTIVE).order_by("-created_at").first())
        if active is not None and not active.params.get("closing"):
            if active.state == JobState.RUNNING and not active.params.get("again"):
                active.params["again"] = True
                active.save(update_fields=["params"])
            return active
        return job_start(kind=KIND, title=f"Apply {deployment.name}", target_type="deployment", target_id=deployment.pk,
                         steps=APPLY.step_names, user=user)


def queued_woken(cluster_id: int, *, besides: int | None = None) -> None:
    """Room may have appeared on the cluster (a copy stopped, a deployment went, machines joined or came
    back): once the transaction commits, the apply job of each deployment there with queued copies plans
    them again (a running one goes round once more). ``besides``: the deployment whose own job freed the
    room, which plans its queued copies in the same round anyway. A cluster that is not running starts
    nothing: its start applies every deployment."""
    def wake() -> None:
        if not Cluster.objects.filter(pk=cluster_id, state=ClusterState.RUNNING).exists():
            return
        waiting = (Deployment.objects.filter(cluster_id=cluster_id, deleting_since__isnull=True,
                                             copy_rows__state=CopyState.QUEUED).exclude(pk=besides).distinct())
        for deployment in waiting.order_by("pk"):
            apply_start(deployment)

    transaction.on_commit(wake)


def another_round(job: Job) -> bool:
    """Asked by the apply job before it ends: was more asked of it meanwhile? If not, it says it is closing."""
    with transaction.atomic():
        row = Job.objects.select_for_update(no_key=True).get(pk=job.pk)
        again = bool(row.params.pop("again", False))
        if not again:
            row.params["closing"] = True
        row.save(update_fields=["params"])
        job.params = row.params
    return again


def addresses_fill(deployment: Deployment) -> None:
    """Each placed copy listens on its machine's address on the cluster's network."""
    addresses = dict(ClusterMember.objects.filter(cluster_id=deployment.cluster_id).values_list("machine_id", "address"))
    for copy in deployment.copy_rows.filter(machine__isnull=False):
        address = addresses.get(copy.machine_id)
        if address and copy.address != address:
            Copy.objects.filter(pk=copy.pk).update(address=address)


def copy_stop_begin(copy: Copy) -> None:
    """Scaling down: a copy that holds nothing goes at once; the others are stopped by the apply job."""
    if copy.state in HOLDS_ROOM:
        copy_transition(copy, to=CopyState.STOPPING, reason="Scaled down: stopping.")
    else:
        copy.delete()
        if copy.machine_id:  # a queued copy with a place kept it for its turn: another may take it
            queued_woken(copy.deployment.cluster_id, besides=copy.deployment_id)


@dataclass(frozen=True)
class Deleted:
    job: Job | None  # stopping its copies; None when nothing had to stop, or nothing could be
    left_on: tuple[str, ...] = ()  # machines whose copies run on without a deployment (the cluster could not be reached)
    cluster: str = ""

    @property
    def words(self) -> str:
        if self.job is not None:
            return "Its copies stop, then it is deleted."
        if self.left_on:
            return (f"Deleted. {self.cluster} could not be reached, so its copies on {', '.join(self.left_on)} keep "
                    "running without a deployment: they hold their GPUs and answer at the gateway. Take them over "
                    f"under Models running here without a deployment on {self.cluster}'s page once it is back.")
        return "Deleted."


def delete_start(deployment: Deployment, *, user=None) -> Deleted:
    """Delete: stop the copies that run, then the record goes. When the cluster cannot be reached (not
    running, or no machine up) nothing can be stopped: copies that hold room are left running without a
    deployment (``deployment_orphan``), the others go at once."""
    running = deployment.copy_rows.filter(state__in=HOLDS_ROOM)
    cluster = deployment.cluster
    reachable = cluster.state == ClusterState.RUNNING and cluster.members.filter(state=MemberState.JOINED).exists()
    if not running.exists() or not reachable:
        pk, cluster_id = deployment.pk, deployment.cluster_id
        left = tuple(dict.fromkeys(n for n in running.values_list("machine__name", flat=True) if n))
        if left:
            deployment_orphan(deployment, reason=f"Deleted while {cluster.name} could not be reached.")
        else:
            deployment.delete()
        transaction.on_commit(lambda: deployment_changed(pk, cluster_id))
        queued_woken(cluster_id)  # its queued copies' places are free
        return Deleted(job=None, left_on=left, cluster=cluster.name)
    Deployment.objects.filter(pk=deployment.pk).update(deleting_since=timezone.now())
    for copy in deployment.copy_rows.all():
        copy_stop_begin(copy)
    return Deleted(job=job_start(kind=DELETE_KIND, title=f"Delete {deployment.name}", target_type="deployment",
                                 target_id=deployment.pk, steps=DELETE.step_names, user=user))


def deployment_orphan(deployment: Deployment, *, reason: str) -> None:
    """A delete that could not stop every copy: the deployment leaves the lists but its record stays, marked
    ``orphaned_at``, with the copies that may still run. They keep their rows, so placement still counts their
    GPUs and the gateway still routes their name to them (what the machines really do); copies that hold
    nothing go. The cluster's page lists it under Models running here without a deployment, where it is
    taken over: kept, or deleted properly (``deployments/orphans.py``)."""
    now = timezone.now()
    deployment.copy_rows.exclude(state__in=HOLDS_ROOM).delete()
    # A stop that did not get through leaves the engine as it was: serving if it served (as far as anyone can
    # tell), else as good as failed (the gateway is not sent to an engine that never answered).
    copies_transition(deployment.copy_rows.filter(serving_since__isnull=False), to=CopyState.SERVING,
                      only_from=[CopyState.STOPPING], reason=f"Running without a deployment: {reason}")
    copies_transition(deployment.copy_rows.all(), to=CopyState.FAILED, only_from=[CopyState.STOPPING],
                      reason=f"Running without a deployment: {reason}")
    Copy.objects.filter(deployment=deployment).exclude(state=CopyState.SERVING).update(
        state_reason=f"Running without a deployment: {reason}")
    Deployment.objects.filter(pk=deployment.pk).update(orphaned_at=now, deleting_since=None,
                                                       copies=deployment.copy_rows.count())
    deployment.orphaned_at, deployment.deleting_since = now, None


def delete_abandoned(job: Job) -> None:
    """The reaper gave up on a delete: what it could not stop runs on without a deployment (never silently)."""
    deployment = Deployment.objects.select_related("cluster").filter(pk=job.target_id, orphaned_at__isnull=True).first()
    if deployment is not None and deployment.deleting_since:
        deployment_orphan(deployment, reason="its delete stopped before its copies did.")
        transaction.on_commit(lambda: deployment_changed(deployment.pk, deployment.cluster_id))


# -- the jobs ---------------------------------------------------------------------------------------


def _resumed(deployment: Deployment) -> None:
    """A worker died in the middle of this job (the only one that claims copies): what it had claimed
    but not started goes back to the queue; engines it started are looked at again. A copy that reads
    Starting with no engine recorded may never have been started (the worker stopped before it asked the
    machine): one its machine does not list goes back to the queue in its place too, and is claimed again."""
    copies_transition(deployment.copy_rows.all(), to=CopyState.QUEUED, reason="Waiting for its turn to start.",
                      only_from=[CopyState.COPYING])
    unsure: dict[int, list[Copy]] = {}
    for copy in deployment.copy_rows.filter(state=CopyState.STARTING, pid__isnull=True).select_related("machine"):
        unsure.setdefault(copy.machine_id, []).append(copy)

    def look(copies: list[Copy]) -> None:
        try:
            with Agent.open(copies[0].machine) as agent:
                listed = {s.copy for s in agent.copy_list()}
        except AgentError:
            return  # not known: the wait asks again
        for copy in copies:
            if copy.key not in listed:
                copy_transition(copy, to=CopyState.QUEUED, only_from=[CopyState.STARTING],
                                reason="Waiting for its turn to start: the worker starting it stopped.")

    each(list(unsure.values()), look)


def apply_abandoned(job: Job) -> None:
    """The reaper gave up on the apply job: copies it had claimed or was starting go back to the queue
    (they would read Copying the model or Starting for ever, holding their room), for the next apply."""
    copies_transition(Copy.objects.filter(deployment_id=job.target_id), to=CopyState.QUEUED,
                      reason="Waiting for its turn to start: the worker starting it stopped.",
                      only_from=[CopyState.COPYING, CopyState.STARTING], pid=None)
    transaction.on_commit(lambda: deployment_changed(job.target_id))


def apply_once(ctx: JobContext, deployment_id: int) -> list[str]:
    deployment = Deployment.objects.select_related("cluster", "model").filter(pk=deployment_id).first()
    if deployment is None or deployment.deleting_since or deployment.orphaned_at:
        return []
    if ctx.job.resumes:
        _resumed(deployment)
    stops(deployment)
    _queued_placed_again(deployment)
    if deployment.model.state != ModelState.READY:
        copies_transition(deployment.copy_rows.all(), to=CopyState.QUEUED, only_from=[CopyState.QUEUED],
                          reason=f"Waiting for {deployment.model} to be in the server's store.")
        ctx.detail(f"Waiting for {deployment.model}'s download")
        deployment_changed(deployment)
        return []
    mine = _claim(deployment)
    starting = list(deployment.copy_rows.filter(state=CopyState.STARTING).select_related("machine"))
    if not mine and not starting:
        ctx.detail("Nothing to start")
        deployment_changed(deployment)
        return []

    COPY_FILES.always(ctx)
    mine = _files(ctx, deployment, mine) if mine else []
    START.always(ctx)
    failures = each(mine, lambda c: _start(deployment, c))
    started = starting + [c for c in mine if c.state == CopyState.STARTING]
    WAIT.always(ctx, f"{len(started)} cop{'ies' if len(started) != 1 else 'y'} loading the model")
    failures += _wait(ctx, deployment, started)
    deployment_changed(deployment)
    return failures


def delete_run(ctx: JobContext, *, deployment_id: int) -> None:
    deployment = Deployment.objects.select_related("cluster").filter(pk=deployment_id).first()
    if deployment is None:
        return
    STOP.always(ctx)
    failures = stops(deployment)
    if failures:
        # Deleted all the same, as asked: what could not be stopped is not lost, it runs without a deployment.
        deployment_orphan(deployment, reason=f"its delete could not stop it ({'; '.join(failures)}).")
        deployment_changed(deployment)
        raise JobError("; ".join(failures) + f". Those copies run without a deployment: take them over on "
                       f"{deployment.cluster.name}'s page (Models running here without a deployment) once the "
                       "machines are back.", kind=ErrorKind.NOT_RETRYABLE)
    pk, cluster_id = deployment.pk, deployment.cluster_id
    deployment.delete()
    ctx.on_success(lambda: deployment_changed(pk, cluster_id))


def _members(deployment: Deployment) -> dict[int, ClusterMember]:
    return {m.machine_id: m for m in ClusterMember.objects.filter(cluster_id=deployment.cluster_id).select_related("machine", "cluster")}


def stops(deployment: Deployment, *, grace_over=()) -> list[str]:
    """Stop every copy being stopped: scaled down or deleted ones go, those of a stopping cluster stay Stopped.
    ``grace_over``: copies leaving a draining machine whose requests have finished (the drain's job says so)."""
    # A copy leaving a draining machine finishes the requests it holds first: the drain's job stops it after
    # FADEN_DRAIN_GRACE seconds out of the rotation (deployments/drain_job.py).
    in_grace = Q(machine__drain__state=DrainState.MOVING,
                 state_changed_at__gt=timezone.now() - timedelta(seconds=settings.FADEN_DRAIN_GRACE))
    in_grace &= ~Q(pk__in=list(grace_over))
    stopping = list(deployment.copy_rows.filter(state=CopyState.STOPPING).exclude(in_grace).select_related("machine"))
    if not stopping:
        return []
    members = _members(deployment)

    def stop(copy: Copy) -> str | None:
        if failures := copy_procs.stop(copy, members):
            return "; ".join(failures)
        copy.delete()
        return None

    failures = each(stopping, stop)
    deployment_changed(deployment)
    if len(failures) < len(stopping):  # their GPUs are free: copies queued elsewhere on the cluster may fit
        queued_woken(deployment.cluster_id, besides=deployment.pk)
    return failures


def _queued_placed_again(deployment: Deployment) -> None:
    """Copies waiting for room (or whose machine left) are planned again: room may have appeared."""
    waiting = list(deployment.copy_rows.filter(state=CopyState.QUEUED).filter(
        Q(machine__isnull=True) | ~Q(machine__membership__cluster_id=deployment.cluster_id)
        | ~Q(machine__membership__state=MemberState.JOINED)).order_by("number"))
    if not waiting:
        return
    ask = ask_of(deployment)
    with transaction.atomic():
        plan = placement.plan(placement_input.cluster_rooms(deployment.cluster, leaving_out=[c.pk for c in waiting]),
                              ask.wanted(len(waiting), deployment_id=deployment.pk), port_range=port_range())
        for copy, placed in zip(waiting, plan.placed):
            Copy.objects.filter(pk=copy.pk).update(machine_id=placed.slots[0].machine_id, port=placed.slots[0].port,
                                                   slots=[slot_json(s) for s in placed.slots],
                                                   state_reason="Waiting for its turn to start.")
        for copy, unplaced in zip(waiting[len(plan.placed):], plan.unplaced):
            # A copy a drain stopped keeps saying so (the drain's words, then what is missing now).
            drained = re.search(r"stopped by the drain of [^;\s]+", copy.state_reason or "")
            why = f"{drained.group(0).rstrip('.')}; {unplaced.reason}" if drained else unplaced.reason
            Copy.objects.filter(pk=copy.pk).update(machine=None, slots=[], port=None, address=None,
                                                   state_reason=f"Waiting for room: {why}.")
    addresses_fill(deployment)


def _claim(deployment: Deployment) -> list[Copy]:
    """The queued copies that have a place, each taken by this job alone."""
    claimed = []
    for copy in deployment.copy_rows.filter(state=CopyState.QUEUED, machine__isnull=False).select_related("machine"):
        if copy_transition(copy, to=CopyState.COPYING, reason="Its machine gets the model's files.",
                           only_from=[CopyState.QUEUED]):
            claimed.append(copy)
    deployment_changed(deployment)
    return claimed


def _files(ctx: JobContext, deployment: Deployment, mine: list[Copy]) -> list[Copy]:
    """The model's files onto every machine of the claimed copies that lacks them; copies whose machine
    did not get them read Failed with why."""
    members = _members(deployment)
    machine_ids = {slot["machine"] for copy in mine for slot in copy.slots}
    holding = set(ModelHolding.objects.filter(model=deployment.model, machine_id__in=machine_ids).values_list("machine_id", flat=True))
    lacking = [members[m] for m in sorted(machine_ids - holding) if m in members]
    if not lacking:
        ctx.detail("Every machine holds the model already")
        return mine
    failed = machine_files.files_to_members(ctx, deployment.cluster, deployment.model, lacking, steps=False)
    failed_machines = {m.machine_id: failed[m.pk] for m in lacking if m.pk in failed}
    kept = []
    for copy in mine:
        why = next((failed_machines[s["machine"]] for s in copy.slots if s["machine"] in failed_machines), None)
        if why:
            copy_transition(copy, to=CopyState.FAILED, reason=f"The model's files did not reach its machine: {why}")
        else:
            kept.append(copy)
    return kept


def command_of(deployment: Deployment, copy: Copy, model_dir: str, *, api_key: str | None = None,
               tls: bool = False) -> engine.EngineCommand:
    first = copy.slots[0]
    return engine.vllm_command(
        model_dir=model_dir, name=deployment.name, address=copy.address, port=copy.port, vendor=deployment.gpu_vendor,
        gpu_indices=first["gpus"], machines=len(copy.slots), memory_per_gpu_mib=deployment.memory_per_gpu_mib,
        gpu_memory_mib=deployment.gpu_memory_mib, context_length=deployment.context_length,
        options=deployment.engine_options, api_key=api_key, tls=tls)


def _start(deployment: Deployment, copy: Copy) -> str | None:
    holding = ModelHolding.objects.filter(model=deployment.model, machine_id=copy.machine_id).first()
    if holding is None:
        copy_transition(copy, to=CopyState.FAILED, reason="Its machine does not hold the model's files.")
        return f"{copy}: its machine does not hold the model's files"
    tls = deployment.cluster.model_tls  # model traffic over mutual TLS (copy_tls.py)
    command = command_of(deployment, copy, holding.path, api_key=copy_keys.copy_key_ensure(copy), tls=tls)
    members = _members(deployment)
    if tls:
        first = members.get(copy.machine_id)
        try:
            if first is None:
                raise copy_tls.CertificateFailed(f"{copy.machine.name} is not in {deployment.cluster.name} any more.")
            copy_tls.certificates_ensure(deployment.cluster, first)
        except copy_tls.CertificateFailed as exc:
            words = getattr(exc, "message", None) or str(exc)
            copy_transition(copy, to=CopyState.FAILED, reason=f"No certificate for its TLS: {words}")
            return f"{copy}: {words}"
    copy_transition(copy, to=CopyState.STARTING, reason="The engine loads the model.", log_tail="", tls=tls)
    try:
        pid = copy_procs.start(deployment, copy, command, members)
    except copy_procs.CopyStartError as exc:
        copy_transition(copy, to=CopyState.FAILED, reason=str(exc))
        return f"{copy}: {exc}"
    Copy.objects.filter(pk=copy.pk).update(pid=pid)
    deployment_changed(deployment)
    return None


def _wait(ctx: JobContext, deployment: Deployment, started: list[Copy]) -> list[str]:
    """Ask the machines about their starting copies until each serves or fails (or the start timeout)."""
    deadline = time.monotonic() + settings.FADEN_COPY_START_TIMEOUT
    waiting = {c.pk: c for c in started}
    failures: list[str] = []
    while waiting:
        ctx.check_cancel()
        by_machine: dict[int, list[Copy]] = {}
        for copy in waiting.values():
            by_machine.setdefault(copy.machine_id, []).append(copy)

        def look(copies: list[Copy]) -> str | None:
            machine = copies[0].machine
            try:
                with Agent.open(machine) as agent:
                    listed = {s.copy: s for s in agent.copy_list()}
            except AgentError as exc:
                return None if exc.kind == ErrorKind.UNREACHABLE else f"{machine.name}: {exc.message}"
            for copy in copies:
                status = listed.get(copy.key)
                if status is not None and status.healthy:
                    copy_transition(copy, to=CopyState.SERVING, reason="", pid=status.pid, serving_since=timezone.now(),
                                    log_tail="")
                    waiting.pop(copy.pk, None)
                elif status is None or not status.running:
                    words = (status.log_tail if status else "") or "The engine is not running."
                    copy_transition(copy, to=CopyState.FAILED, reason=last_line(words), log_tail=words)
                    failures.append(f"{copy} on {machine.name}: {last_line(words)}")
                    waiting.pop(copy.pk, None)
                elif status.log_tail != copy.log_tail:
                    Copy.objects.filter(pk=copy.pk).update(log_tail=status.log_tail)
                    copy.log_tail = status.log_tail
            return None

        failures += each(list(by_machine.values()), look)
        ctx.detail(f"{len(waiting)} cop{'ies' if len(waiting) != 1 else 'y'} loading the model" if waiting else "Serving")
        deployment_changed(deployment)
        if waiting and time.monotonic() > deadline:
            for copy in waiting.values():
                copy_transition(copy, to=CopyState.FAILED,
                                reason=f"Not serving after {settings.FADEN_COPY_START_TIMEOUT} s: {last_line(copy.log_tail)}")
                failures.append(f"{copy} did not serve in time")
            break
        if waiting:
            time.sleep(POLL_SECONDS)  # the machines are asked again: loading a model takes what it takes
    return failures


def last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


# -- the cluster's life ------------------------------------------------------------------------------


def cluster_stopping(cluster, deleting: bool = False) -> None:
    """Stop keeps the deployments; its copies read Stopped (the runtime's stop ends their engines). A model
    running without a deployment ends with the runtime too: its record goes (one that outlives the stop, on a
    machine the stop could not reach, is found again by Look for them as an engine no record knows)."""
    Deployment.objects.filter(cluster=cluster, orphaned_at__isnull=False).delete()
    copies_transition(Copy.objects.filter(deployment__cluster=cluster), to=CopyState.STOPPED,
                      reason=f"{cluster.name} is stopped: started again when it starts.",
                      only_from=HOLDS_ROOM | {CopyState.QUEUED}, pid=None)
    for pk in Deployment.objects.filter(cluster=cluster).values_list("pk", flat=True):
        transaction.on_commit(lambda pk=pk: deployment_changed(pk, cluster.pk))


def cluster_running(cluster) -> None:
    """Start (or a head's restart) applies the cluster's models again: their copies start where they were."""
    for deployment in Deployment.objects.filter(cluster=cluster, deleting_since__isnull=True, orphaned_at__isnull=True):
        copies_transition(deployment.copy_rows.all(), to=CopyState.QUEUED, reason="Waiting for its turn to start.",
                          only_from=[CopyState.STOPPED, CopyState.SERVING, CopyState.STARTING, CopyState.COPYING,
                                     CopyState.FAILED], pid=None)
        apply_start(deployment)


def active_job(deployment: Deployment) -> Job | None:
    return (Job.objects.filter(target_type="deployment", target_id=deployment.pk, state__in=JOB_ACTIVE)
            .order_by("-created_at").first())
