"""Reads of the model store shared by the Models pages, the API and the cluster page's cards."""
from __future__ import annotations

from django.db.models import Count

from clusters.choices import ClusterState
from clusters.models import Cluster, ClusterMember
from console.choices import JOB_ACTIVE
from console.models import Job
from deployments.models import ModelHolding, StoredModel


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
