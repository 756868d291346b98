"""Reads of deployments and their copies shared by the pages, the API and the cluster page's cards."""
from __future__ import annotations

from django.db.models import Count, Q

from clusters.actions import DEPLOYS_ON
from clusters.models import Cluster
from console.models import Job
from deployments.choices import CopyState, ModelState
from deployments.models import Copy, Deployment, StoredModel


def deployments_list(queryset=None, limit: int | None = None) -> list[Deployment]:
    """Deployments with their copies counted by state, in one query."""
    rows = deployments_counted(queryset)
    return list(rows[:limit] if limit else rows)


def deployments_counted(queryset=None):
    """Deployments (all, or those of ``queryset``) annotated with their copies by state, by name; never those
    whose copies run without a deployment (``Deployment.orphaned_at``)."""
    return (queryset if queryset is not None else Deployment.objects.all()).shown().select_related("cluster", "model").annotate(
        serving=Count("copy_rows", filter=Q(copy_rows__state=CopyState.SERVING)),
        failed=Count("copy_rows", filter=Q(copy_rows__state=CopyState.FAILED)),
        queued=Count("copy_rows", filter=Q(copy_rows__state=CopyState.QUEUED)),
        starting=Count("copy_rows", filter=Q(copy_rows__state__in=(CopyState.COPYING, CopyState.STARTING))),
    ).order_by("name")


def deploy_clusters() -> list[Cluster]:
    """The clusters the Deploy form offers: those deploying is allowed on (clusters/actions.py's rule)."""
    return list(Cluster.objects.filter(state__in=DEPLOYS_ON).order_by("name"))


def deploy_models() -> list[StoredModel]:
    return list(StoredModel.objects.filter(state__in=(ModelState.READY, ModelState.DOWNLOADING)).order_by("repo", "revision"))


def deployment_jobs(deployment: Deployment, limit: int = 5) -> list[Job]:
    return list(Job.objects.filter(target_type="deployment", target_id=deployment.pk).defer("log").order_by("-created_at")[:limit])


def machine_copies(machine) -> list[Copy]:
    """The copies whose engine runs on the machine (a machine page's card)."""
    return list(Copy.objects.filter(machine=machine).select_related("deployment").order_by("deployment__name", "number"))
