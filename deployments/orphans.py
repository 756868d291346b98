"""Models running without a deployment: finding them, and taking them over.

A deployment deleted while its copies could not be stopped (its cluster could not be reached, or the reaper
gave up on the delete) does not vanish: ``serving.deployment_orphan`` keeps its record, marked ``orphaned_at``,
with the copies that may still run. Keeping the rows, rather than a separate list, is what lets the rest of the
console go on telling the truth with nothing added: placement counts their GPUs (``placement_input`` reads Copy
rows), the gateway routes their name to them (it reads Serving copies), and the cluster cannot be deleted under
them. What changes is where they show: no longer among the deployments (the lists, the API, the cluster's
models card), but under **Models running here without a deployment** on the cluster's page.

Two jobs, one at a time per cluster (their target is ``cluster.orphans``, so the cluster's own actions are
never held up by them):

- **Look for them** (``LOOK_KIND``) asks every member's agent which engines it runs (``copy list``). Copies of a
  model without a deployment that are found get their process ids; those whose machine answered without them
  are gone (their GPUs are free again). Engines no record knows at all (started by a console whose record is
  gone) are kept in the job's ``params["unknown"]``, grouped by the name they serve, each with whether it can be
  kept and why not (``orphan_engines.shape``), so the card shows the last look's findings.
- **Take over a model** (``TAKE_KIND``, ``params = {"name", "keep"}``): *keep it* makes it a deployment again with
  its copies as they are, never restarted (same processes): a known one loses its mark; one no record knew gets
  a deployment and copies written from what its agent reported. *Delete it properly* stops its engines (and a
  spanning copy's Ray nodes) and frees its GPUs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from clusters.choices import ClusterState
from clusters.fanout import each
from clusters.lifecycle import cluster_changed
from clusters.models import Cluster, ClusterMember
from console import roles
from console.choices import JOB_ACTIVE, ErrorKind, JobState
from console.jobs import JobContext, JobError, Operation, Step, job_start
from console.models import Job
from console.offers import Offer
from console.roles import OPERATOR, Action
from deployments import copy_procs, orphan_engines, serving
from deployments.choices import CopyState
from deployments.models import Copy, Deployment, ModelHolding
from machines.agent_client import Agent, AgentError
from machines.models import Accelerator

TARGET = "cluster.orphans"  # the jobs' target_type; their target_id is the cluster's
LIVE_PART = "orphans"  # the card's name, and the part of the cluster's topic that renders it alone

LOOK_KIND = "deployment.orphans_look"
ASK = Step("Ask every machine which engines it runs")
LOOK = Operation(LOOK_KIND, (ASK,))

TAKE_KIND = "deployment.orphan_take"
FIND = Step("Find its engines")
KEEP = Step("Keep it as a deployment")
STOP = Step("Stop its engines")

LOOK_FOR = Action("looking for models running without a deployment", OPERATOR)
TAKE_OVER = Action("taking over a model running without a deployment", OPERATOR)


@dataclass
class Orphan:
    """A model running on the cluster without a deployment, as the card and the API show it."""

    name: str  # the name it answers under at the gateway (or its engine's id on the machine)
    model: str
    known: bool  # a record of the console knows its copies (a deployment deleted while they could not stop)
    engines: list[dict] = field(default_factory=list)  # {"machine_name", "copy", "pid", "gpus", "port", "since", "healthy"}
    since: datetime | str | None = None  # orphaned at (known), or the first engine's start (unknown)
    keep_refusal: str | None = None  # why it cannot be kept (then only delete is offered)

    @property
    def gpus(self) -> int:
        return sum(len(e.get("gpus") or []) for e in self.engines)


# -- offers -------------------------------------------------------------------------------------------


def orphans_busy(cluster: Cluster) -> Job | None:
    """The look or take-over under way on the cluster, if any: one at a time."""
    return Job.objects.filter(target_type=TARGET, target_id=cluster.pk, state__in=JOB_ACTIVE).first()


def look_offer(cluster: Cluster, role: roles.Role | None) -> Offer:
    busy = orphans_busy(cluster)
    return LOOK_FOR.offer(role).then(Offer(busy is None, f"{busy.title} is under way: wait for it to end." if busy else "")).then(
        Offer(cluster.members.exists(), f"{cluster.name} has no machines to ask."))


def take_offer(cluster: Cluster, orphan: Orphan | None, *, keep: bool, role: roles.Role | None) -> Offer:
    offer = look_offer(cluster, role)
    if not offer.ok:
        return offer
    if orphan is None:
        return Offer(False, f"No model runs on {cluster.name} without a deployment under that name: look for them again.")
    if keep and cluster.state != ClusterState.RUNNING:
        return Offer(False, f"{cluster.name} is {cluster.get_state_display().lower()}: a model is kept on a running "
                            "cluster only. Start it first, or delete the model properly.")
    if keep and orphan.keep_refusal:
        return Offer(False, f"{orphan.name} cannot be kept: {orphan.keep_refusal} Delete it properly instead.")
    return offer


# -- reads ----------------------------------------------------------------------------------------------


def last_look(cluster: Cluster) -> Job | None:
    return Job.objects.filter(kind=LOOK_KIND, target_type=TARGET, target_id=cluster.pk).defer("log").order_by("-created_at").first()


def orphans_of(cluster: Cluster) -> list[Orphan]:
    """What runs on the cluster without a deployment: the copies records know (always), then the engines no
    record knows that the last successful look found (and nobody took over since)."""
    found = []
    for deployment in (Deployment.objects.filter(cluster=cluster, orphaned_at__isnull=False).select_related("model")
                       .prefetch_related("copy_rows__machine").order_by("name")):
        found.append(Orphan(name=deployment.name, model=str(deployment.model), known=True, since=deployment.orphaned_at,
                            engines=[_copy_engine(c) for c in deployment.copy_rows.all()]))
    look = Job.objects.filter(kind=LOOK_KIND, target_type=TARGET, target_id=cluster.pk,
                              state=JobState.SUCCEEDED).only("params").order_by("-created_at").first()
    known_names = {o.name for o in found}
    for name, entry in (look.params.get("unknown", {}) if look else {}).items():
        if name not in known_names:
            found.append(Orphan(name=name, model=entry.get("model") or entry.get("model_dir") or "unknown", known=False,
                                engines=entry["engines"], since=min((e["since"] for e in entry["engines"] if e["since"]), default=None),
                                keep_refusal=entry.get("keep_refusal")))
    return found


def orphan_named(cluster: Cluster, name: str) -> Orphan | None:
    return next((o for o in orphans_of(cluster) if o.name == name), None)


def _copy_engine(copy: Copy) -> dict:
    gpus = [i for slot in copy.slots for i in slot.get("gpus", [])]
    return {"machine_name": copy.machine.name if copy.machine else "", "copy": copy.key, "pid": copy.pid, "gpus": gpus,
            "port": copy.port, "since": copy.serving_since.isoformat() if copy.serving_since else None,
            "healthy": copy.state == CopyState.SERVING, "state": copy.get_state_display()}


def orphans_changed(cluster_id: int) -> None:
    """Push the card (its part of the cluster's topic) and the models card, whose lists it changes."""
    cluster_changed(cluster_id, part=LIVE_PART)
    cluster_changed(cluster_id, part="deployments")


# -- starting the jobs ------------------------------------------------------------------------------------


def orphans_look_start(*, cluster: Cluster, user=None) -> Job:
    """Look for them: a job asks every machine of the cluster which engines it runs."""
    with transaction.atomic():
        cluster = Cluster.objects.select_for_update(no_key=True).get(pk=cluster.pk)
        look_offer(cluster, roles.acting(user)).check()
        return job_start(kind=LOOK_KIND, title=f"Look for models running on {cluster.name} without a deployment",
                         target_type=TARGET, target_id=cluster.pk, steps=LOOK.step_names, user=user)


def orphan_take_over(*, cluster: Cluster, name: str, keep: bool, user=None) -> Job:
    """Take over a model running without a deployment: keep it (a deployment again, its copies as they run)
    or delete it properly (its engines stopped, its GPUs free)."""
    with transaction.atomic():
        cluster = Cluster.objects.select_for_update(no_key=True).get(pk=cluster.pk)
        take_offer(cluster, orphan_named(cluster, name), keep=keep, role=roles.acting(user)).check()
        steps = [FIND.name, KEEP.name] if keep else [STOP.name]
        return job_start(kind=TAKE_KIND, title=f"{'Keep' if keep else 'Delete'} {name} (running without a deployment)",
                         target_type=TARGET, target_id=cluster.pk, steps=steps, user=user,
                         params={"name": name, "keep": keep})


# -- Look for them ---------------------------------------------------------------------------------------


def _listings(cluster: Cluster) -> tuple[dict[int, list], dict[int, str], list[str]]:
    """Every member's ``copy list``, by machine id; the machines' names; the machines that could not be asked."""
    members = list(ClusterMember.objects.filter(cluster=cluster).select_related("machine"))
    names = {m.machine_id: m.machine.name for m in members}
    listings: dict[int, list] = {}

    def ask(member: ClusterMember) -> str | None:
        try:
            with Agent.open(member.machine) as agent:
                listings[member.machine_id] = agent.copy_list()
        except AgentError as exc:
            return f"{member.machine.name}: {exc.message}"
        return None

    return listings, names, each(members, ask)


def _known_copies(keys: set[str]) -> dict[str, Copy]:
    """The Copy rows of those agent ids (``d<deployment>-c<number>``, or a kept engine's own id), by id."""
    pairs = {(int(m["deployment"]), int(m["number"])) for k in keys if (m := orphan_engines.COPY_KEY_RE.match(k))}
    rows = list(Copy.objects.filter(agent_key__in=keys).select_related("deployment"))
    if pairs:
        rows += Copy.objects.filter(deployment_id__in={d for d, _ in pairs}, agent_key="").select_related("deployment")
    return {c.key: c for c in rows if c.key in keys}


def orphans_look_run(ctx: JobContext, *, cluster_id: int) -> None:
    cluster = Cluster.objects.get(pk=cluster_id)
    ASK.always(ctx)
    listings, names, not_asked = _listings(cluster)
    # Every engine counts, whichever cluster it was started for: one a machine's earlier cluster left running
    # holds its GPUs here just the same (it is kept only if it was started for this one: ``_keep_check``).
    listed = {(machine_id, s.copy): s for machine_id, statuses in listings.items() for s in statuses}
    known = _known_copies({key for _, key in listed})
    engines: dict[str, dict] = {}  # engines no record knows, by their id
    for (machine_id, key), status in listed.items():
        if orphan_engines.is_ray_node(key) or (key in known and known[key].placed_on(machine_id)):
            continue  # an engine its copy's record places elsewhere (moved while its machine was away) is no copy's
        engines[key] = orphan_engines.engine_entry(status, machine_id=machine_id, machine_name=names[machine_id])
    for (machine_id, key), status in listed.items():  # a spanning engine's Ray nodes go with it (delete stops them)
        if orphan_engines.is_ray_node(key) and (owner := engines.get(key[:-len(orphan_engines.RAY_NODE_SUFFIX)])):
            owner["nodes"].append(machine_id)
    _known_found(cluster, listings, listed)
    unknown = {}
    for name, group in orphan_engines.grouped(list(engines.values())).items():
        unknown[name] = {"engines": group, "keep_refusal": None, "model": None}
        unknown[name]["model"], unknown[name]["keep_refusal"] = _keep_check(cluster, name, group)
    Job.objects.filter(pk=ctx.job.pk).update(params=ctx.job.params | {"unknown": unknown, "not_asked": not_asked})
    orphaned = Deployment.objects.filter(cluster=cluster, orphaned_at__isnull=False).count()
    words = f"{orphaned + len(unknown)} model{'s' if orphaned + len(unknown) != 1 else ''} running without a deployment"
    ctx.detail(words + (f"; not asked: {'; '.join(not_asked)}" if not_asked else ""))
    serving.queued_woken(cluster.pk)  # copies found gone freed their GPUs


def _known_found(cluster: Cluster, listings: dict[int, list], listed: dict) -> None:
    """The copies of models without a deployment, against what their machines said: found ones get their
    process ids (and read Serving when they answer), those whose machine answered without them are gone, and
    a model with no copy left goes too."""
    for copy in Copy.objects.filter(deployment__cluster=cluster, deployment__orphaned_at__isnull=False).select_related("deployment"):
        if copy.machine_id not in listings:
            continue  # its machine was not asked: nothing is known of it
        status = listed.get((copy.machine_id, copy.key))
        if status is None or not status.running:
            copy.delete()
            continue
        Copy.objects.filter(pk=copy.pk).update(pid=status.pid)
        if status.healthy:
            serving.copy_transition(copy, to=CopyState.SERVING, reason=copy.state_reason, only_from=[CopyState.STOPPING])
    for deployment in Deployment.objects.filter(cluster=cluster, orphaned_at__isnull=False, copy_rows__isnull=True):
        deployment.delete()


def _keep_check(cluster: Cluster, name: str, engines: list[dict]) -> tuple[str | None, str | None]:
    """The model an engine no record knows serves (as the store names it), and why it cannot be kept (None
    when it can): what it reports must make a deployment (``orphan_engines.shape``), of a model in the store
    that its machine holds, under a name no deployment has."""
    from deployments.services import NAME_RE  # services imports serving, which the look imports first

    facts, refusal = orphan_engines.shape(engines)
    holding = (ModelHolding.objects.filter(machine_id=engines[0]["machine"], path=facts["model_dir"]).select_related("model").first()
               if facts else None)
    model = str(holding.model) if holding else None
    if refusal:
        return model, refusal
    if strangers := sorted({e["cluster"] for e in engines if e.get("cluster") and e["cluster"] != cluster.name}):
        return model, (f"It was started for the cluster {', '.join(strangers)}, in that cluster's runtime, not "
                       f"{cluster.name}'s.")
    if holding is None:
        return None, (f"It serves {facts['model_dir']}, which is no model of the server's store that "
                      f"{engines[0]['machine_name']} holds, so the console cannot say which model it is.")
    if not NAME_RE.match(name):
        return model, f"It serves under {name}, which is not a name a deployment may have."
    if Deployment.objects.filter(name=name).exists():
        return model, f"A deployment is named {name} already: the gateway routes each name to one deployment."
    return model, None


# -- Take over --------------------------------------------------------------------------------------------


def orphan_take_run(ctx: JobContext, *, cluster_id: int, name: str, keep: bool) -> None:
    cluster = Cluster.objects.get(pk=cluster_id)
    deployment = Deployment.objects.filter(cluster=cluster, name=name, orphaned_at__isnull=False).first()
    if deployment is not None:
        (_keep_known if keep else _delete_known)(ctx, deployment)
    else:
        look = _look_with(cluster, name)
        if look is None:
            raise JobError(f"No model runs on {cluster.name} without a deployment under {name}: look for them again.",
                           kind=ErrorKind.NOT_RETRYABLE)
        (_keep_unknown if keep else _delete_unknown)(ctx, cluster, name, look.params["unknown"][name]["engines"])
        params = Job.objects.get(pk=look.pk).params
        params["unknown"].pop(name, None)
        Job.objects.filter(pk=look.pk).update(params=params)
    serving.queued_woken(cluster.pk)


def _look_with(cluster: Cluster, name: str) -> Job | None:
    look = Job.objects.filter(kind=LOOK_KIND, target_type=TARGET, target_id=cluster.pk,
                              state=JobState.SUCCEEDED).order_by("-created_at").first()
    return look if look is not None and name in look.params.get("unknown", {}) else None


def _members(cluster_id: int) -> dict[int, ClusterMember]:
    return {m.machine_id: m for m in ClusterMember.objects.filter(cluster_id=cluster_id).select_related("machine", "cluster")}


def _keep_known(ctx: JobContext, deployment: Deployment) -> None:
    """It becomes a deployment again, its copies as they run: their machines are asked once more first (each
    copy gets its engine's process id; one whose engine is gone goes), and nothing is started or stopped."""
    FIND.always(ctx)
    members = _members(deployment.cluster_id)
    copies = list(deployment.copy_rows.select_related("machine"))
    listings: dict[int, dict] = {}

    def ask(machine_id: int) -> str | None:
        member = members.get(machine_id)
        if member is None:
            return f"a machine no longer in {deployment.cluster.name}"
        try:
            with Agent.open(member.machine) as agent:
                listings[machine_id] = {s.copy: s for s in agent.copy_list()}
        except AgentError as exc:
            return f"{member.machine.name}: {exc.message}"
        return None

    if failures := each(sorted({c.machine_id for c in copies if c.machine_id}), ask):
        raise JobError(f"Its machines could not all be asked, so it is left as it is: {'; '.join(failures)}.")
    for copy in copies:
        status = listings.get(copy.machine_id, {}).get(copy.key)
        if status is None or not status.running:
            copy.delete()
        else:
            Copy.objects.filter(pk=copy.pk).update(pid=status.pid, state_reason="")
            serving.copy_transition(copy, to=CopyState.SERVING, only_from=[CopyState.STOPPING])
    left = deployment.copy_rows.count()
    if not left:
        deployment.delete()
        raise JobError(f"Nothing of {deployment.name} runs any more: its record went.", kind=ErrorKind.NOT_RETRYABLE)
    KEEP.always(ctx, f"{left} cop{'ies' if left != 1 else 'y'} kept as they run")
    Deployment.objects.filter(pk=deployment.pk).update(orphaned_at=None, deleting_since=None, copies=left)
    ctx.on_success(lambda: serving.deployment_changed(deployment.pk, deployment.cluster_id))


def _delete_known(ctx: JobContext, deployment: Deployment) -> None:
    """Its engines stopped (a spanning copy's Ray nodes too), its copies' rows gone, its GPUs free."""
    STOP.always(ctx)
    members = _members(deployment.cluster_id)

    def stop(copy: Copy) -> str | None:
        if failures := copy_procs.stop(copy, members):
            return "; ".join(failures)
        copy.delete()
        return None

    failures = each(list(deployment.copy_rows.select_related("machine")), stop)
    if failures:
        raise JobError(f"Not every engine of {deployment.name} stopped; the others did: {'; '.join(failures)}.")
    pk, cluster_id = deployment.pk, deployment.cluster_id  # delete() forgets the primary key
    deployment.delete()
    ctx.on_success(lambda: serving.deployment_changed(pk, cluster_id))


def _delete_unknown(ctx: JobContext, cluster: Cluster, name: str, engines: list[dict]) -> None:
    """Each engine stopped on its machine, and a spanning one's Ray nodes on theirs."""
    STOP.always(ctx)
    members = _members(cluster.pk)
    stops = [(e["machine"], e["copy"]) for e in engines]
    stops += [(m, e["copy"] + orphan_engines.RAY_NODE_SUFFIX) for e in engines for m in e.get("nodes", [])]

    def stop(item: tuple[int, str]) -> str | None:
        member = members.get(item[0])
        if member is None:
            return None  # it left the cluster: its runtime's stop ended what ran there
        try:
            with Agent.open(member.machine) as agent:
                agent.copy_stop(item[1])
        except AgentError as exc:
            return f"{member.machine.name}: {exc.message}"
        return None

    if failures := each(stops, stop):
        raise JobError(f"Not every engine of {name} stopped: {'; '.join(failures)}.")
    ctx.detail(f"{len(engines)} engine{'s' if len(engines) != 1 else ''} stopped")


def _keep_unknown(ctx: JobContext, cluster: Cluster, name: str, engines: list[dict]) -> None:
    """A deployment written from what the agents reported, its copies the engines as they run (each keeps the
    id its machine knows it by, ``Copy.agent_key``)."""
    FIND.always(ctx)
    model, refusal = _keep_check(cluster, name, engines)
    if refusal:
        raise JobError(f"{name} cannot be kept: {refusal} Delete it properly instead.", kind=ErrorKind.NOT_RETRYABLE)
    facts, _ = orphan_engines.shape(engines)
    first = engines[0]
    holding = ModelHolding.objects.filter(machine_id=first["machine"], path=facts["model_dir"]).select_related("model", "machine").get()
    gpu = Accelerator.objects.filter(machine_id=first["machine"], index=first["gpus"][0]).first()
    if gpu is None:
        raise JobError(f"{first['machine_name']} has no GPU {first['gpus'][0]} on record: heartbeat it, then try again.",
                       kind=ErrorKind.NOT_RETRYABLE)
    KEEP.always(ctx)
    now = timezone.now()
    with transaction.atomic():
        deployment = Deployment.objects.create(
            name=name, cluster=cluster, model=holding.model, copies=len(engines), gpu_quarters=facts["gpu_quarters"],
            gpu_vendor=gpu.vendor, gpu_model=gpu.model, gpu_memory_mib=gpu.memory_mib, arch=holding.machine.arch,
            memory_per_gpu_mib=int(gpu.memory_mib * facts["memory_fraction"]), context_length=facts["context_length"])
        per_gpu = min(facts["gpu_quarters"], 4)
        Copy.objects.bulk_create([Copy(
            deployment=deployment, number=number, generation=1, agent_key=e["copy"], machine_id=e["machine"],
            slots=[{"machine": e["machine"], "gpus": e["gpus"], "quarters": per_gpu, "port": e["port"]}],
            address=e["address"] or None, port=e["port"], pid=e["pid"], tls=facts["tls"], state_changed_at=now,
            state=CopyState.SERVING if e["healthy"] else CopyState.STARTING, serving_since=now if e["healthy"] else None,
            state_reason="" if e["healthy"] else "Taken over: its engine does not answer yet.")
            for number, e in enumerate(engines, start=1)])
        if not all(e["healthy"] for e in engines):  # its apply job waits for them to answer, as for any start
            serving.apply_start(deployment)
    ctx.detail(f"{name}: {len(engines)} cop{'ies' if len(engines) != 1 else 'y'} kept as they run")
    ctx.on_success(lambda: serving.deployment_changed(deployment.pk, cluster.pk))

