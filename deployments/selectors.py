"""Reads shared by the models' pages, the API and the cluster page's cards."""
from __future__ import annotations

from django.db.models import Count, Q

from clusters.choices import ClusterState
from clusters.models import Cluster, ClusterMember
from console.choices import JOB_ACTIVE
from console.models import Job
from deployments.choices import CopyState, ModelState
from deployments.models import Copy, Deployment, ModelHolding, StoredModel


def models_list():
    return StoredModel.objects.annotate(held_on=Count("holdings")).order_by("repo", "revision")


def model_where(model: StoredModel) -> list[dict]:
    """Each machine that holds the model's files, with the clusters it is in."""
    holdings = list(model.holdings.select_related("machine").order_by("machine__name"))
    clusters: dict[int, list[Cluster]] = {}
    for member in ClusterMember.objects.filter(machine_id__in=[h.machine_id for h in holdings]).select_related("cluster"):
        clusters.setdefault(member.machine_id, []).append(member.cluster)
    return [{"holding": h, "machine": h.machine, "clusters": clusters.get(h.machine_id, [])} for h in holdings]


def models_on_cluster(cluster: Cluster) -> list[dict]:
    """The models the cluster's machines hold, with how many of its machines hold each."""
    machine_ids = list(cluster.members.values_list("machine_id", flat=True))
    counts: dict[int, int] = {}
    models: dict[int, StoredModel] = {}
    for holding in ModelHolding.objects.filter(machine_id__in=machine_ids).select_related("model"):
        counts[holding.model_id] = counts.get(holding.model_id, 0) + 1
        models[holding.model_id] = holding.model
    return [{"model": models[pk], "machines": counts[pk], "of": len(machine_ids)}
            for pk in sorted(models, key=lambda pk: str(models[pk]))]


def copy_targets() -> list[Cluster]:
    """The clusters a model may be copied to now."""
    return list(Cluster.objects.filter(state__in=(ClusterState.RUNNING, ClusterState.STOPPED)).order_by("name"))


def _jobs_of(model: StoredModel):
    """The model's jobs: its download, removals, and the copies of it to clusters (jobs on the cluster)."""
    return (Job.objects.filter(target_type="model", target_id=model.pk)
            | Job.objects.filter(kind="model.copy", params__model=model.pk)).defer("log")


def model_jobs(model: StoredModel, limit: int = 5) -> list[Job]:
    return list(_jobs_of(model).order_by("-created_at")[:limit])


def model_active_job(model: StoredModel) -> Job | None:
    """The job running on the model now, if any."""
    return _jobs_of(model).filter(state__in=JOB_ACTIVE).first()


def deployments_list(queryset=None, limit: int | None = None) -> list[Deployment]:
    """Deployments with their copies counted by state, in one query."""
    rows = deployments_counted(queryset)
    return list(rows[:limit] if limit else rows)


def deployments_counted(queryset=None):
    """Deployments (all, or those of ``queryset``) annotated with their copies by state, by name."""
    return (queryset if queryset is not None else Deployment.objects.all()).select_related("cluster", "model").annotate(
        serving=Count("copy_rows", filter=Q(copy_rows__state=CopyState.SERVING)),
        failed=Count("copy_rows", filter=Q(copy_rows__state=CopyState.FAILED)),
        queued=Count("copy_rows", filter=Q(copy_rows__state=CopyState.QUEUED)),
        starting=Count("copy_rows", filter=Q(copy_rows__state__in=(CopyState.COPYING, CopyState.STARTING))),
    ).order_by("name")


def deploy_clusters() -> list[Cluster]:
    return list(Cluster.objects.filter(state=ClusterState.RUNNING).order_by("name"))


def deploy_models() -> list[StoredModel]:
    return list(StoredModel.objects.filter(state__in=(ModelState.READY, ModelState.DOWNLOADING)).order_by("repo", "revision"))


def deployment_jobs(deployment: Deployment, limit: int = 5) -> list[Job]:
    return list(Job.objects.filter(target_type="deployment", target_id=deployment.pk).defer("log").order_by("-created_at")[:limit])


def machine_copies(machine) -> list[Copy]:
    """The copies whose engine runs on the machine (a machine page's card)."""
    return list(Copy.objects.filter(machine=machine).select_related("deployment").order_by("deployment__name", "number"))
