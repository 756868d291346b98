"""Where a cluster's machines get models: *Server copies* (the default) or *Machines download models
themselves*, and the check of every machine's reach to the hub that a switch to the second needs.

The switch applies to the next model placed on the cluster: what machines hold already stays. A
switch to machine downloads is a job (the machines are asked over SSH): every machine makes a real
request to the hub with a timeout, and only when all of them get an answer does the cluster switch;
otherwise it keeps Server copies and the card names each machine that cannot reach the hub, and why.
"""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db import transaction

from clusters.choices import ModelSource
from clusters.fanout import each, on_member
from clusters.lifecycle import cluster_changed, cluster_locked
from clusters.models import Cluster
from clusters.selectors import cluster_busy
from console import roles
from console.choices import ErrorKind
from console.jobs import JobContext, JobError, Operation, Step, job_start
from console.models import Job
from console.offers import Offer
from console.roles import OPERATOR, Action
from deployments.store import actions, hub

KIND = "model.source-check"
REACH = Step("Ask every machine to reach the hub")
SWITCH = Step("Switch to machine downloads")
CHECK_REACH = Operation(KIND, (REACH,))
# Switching checks first: the cluster switches only when every machine reached the hub.
SWITCH_SOURCE = Operation(KIND, (REACH, SWITCH))
REACH_TIMEOUT = 5  # seconds each machine waits for the hub's answer

CHANGE = Action("changing where a cluster's machines get models", OPERATOR)


def model_source_set(cluster: Cluster, source: str, *, user=None) -> Job | None:
    """Server copies at once; machine downloads after a check of every machine (the job it returns)."""
    CHANGE.offer(roles.acting(user)).check()
    if source not in ModelSource.values:
        raise ValidationError({"model_source": f"{source!r} is not one of: {', '.join(ModelSource.values)}."})
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        if source == ModelSource.SERVER:
            if cluster.model_source != source:
                Cluster.objects.filter(pk=cluster.pk).update(model_source=source)
                cluster_changed(cluster)
            return None
        if cluster.model_source == source:
            return None
        return _check_start(cluster, switch=True, user=user)


def model_source_check(cluster: Cluster, *, user=None) -> Job:
    """Check every machine's reach to the hub without switching."""
    CHANGE.offer(roles.acting(user)).check()
    with transaction.atomic():
        return _check_start(cluster_locked(cluster), switch=False, user=user)


def _check_start(cluster: Cluster, *, switch: bool, user) -> Job:
    if busy := cluster_busy(cluster):
        raise ValidationError(f"{cluster.name} is busy ({busy.title}): wait for it to end.")
    if not cluster.members.exists():
        raise ValidationError(f"{cluster.name} has no machines to check.")
    if refusal := actions.agents_refusal(cluster):
        raise ValidationError(refusal)
    operation = SWITCH_SOURCE if switch else CHECK_REACH
    title = "Switch to machine downloads" if switch else "Check the machines' reach to the hub"
    return job_start(kind=operation.kind, title=title, target_type="cluster", target_id=cluster.pk,
                     steps=operation.step_names, user=user, params={"switch": switch})


def model_source_check_run(ctx: JobContext, *, cluster_id: int, switch: bool) -> None:
    cluster = Cluster.objects.get(pk=cluster_id)
    members = list(cluster.members.select_related("machine"))
    url = hub.endpoint()
    REACH.always(ctx, url)

    def reach(member) -> str | None:
        try:
            answer = on_member(member, lambda agent: agent.hub_check(url, timeout=REACH_TIMEOUT))
        except JobError as exc:
            return exc.message
        ctx.log(f"{member.machine.name}: the hub answered in {answer.seconds:.2f} s")
        return None

    failures = each(members, reach)
    if failures:
        keeps = f" {cluster.name} keeps Server copies." if switch else ""
        raise JobError(f"Not every machine reaches the hub at {url}: {'; '.join(sorted(failures))}.{keeps}",
                       kind=ErrorKind.NOT_RETRYABLE)
    ctx.detail(f"All {len(members)} machines reach {url}")
    if switch:
        SWITCH.always(ctx)
        Cluster.objects.filter(pk=cluster.pk).update(model_source=ModelSource.MACHINES)
        ctx.on_success(lambda: cluster_changed(cluster))


def model_source_card(cluster: Cluster, role: roles.Role | None) -> dict:
    """The cluster page's "Where the machines get models" card: the source, the last check, the buttons."""
    last = Job.objects.filter(kind=KIND, target_type="cluster", target_id=cluster.pk).only(
        "title", "state", "error", "steps", "finished_at", "kind").first()
    busy = cluster_busy(cluster)
    offer = CHANGE.offer(role).then(Offer(busy is None, f"{cluster.name} is busy ({busy.title})." if busy else ""))
    return {"model_source": {"value": cluster.model_source, "label": cluster.get_model_source_display(),
                             "machines": cluster.model_source == ModelSource.MACHINES, "last_check": last,
                             "endpoint": hub.endpoint(), "offer": offer}}
