"""Every write on the model store: add a model (its download starts), try a failed download again, delete
one, put its files on a cluster's machines or take them away."""
from __future__ import annotations

import shutil

from django.core.exceptions import ValidationError
from django.db import transaction

from clusters.choices import ClusterState
from clusters.selectors import cluster_busy
from console import roles
from console.jobs import job_start
from console.models import Job
from deployments.choices import ModelState
from deployments.models import ModelFile, StoredModel
from deployments.store import actions, disk, downloads, hub, machine_files, selectors


def model_add(*, repo: str, revision: str = "main", user=None) -> StoredModel:
    """Record the model and start its download; the same repository and revision twice is refused."""
    actions.ADD.offer(roles.acting(user)).check()
    repo, revision = (repo or "").strip(), (revision or "").strip() or "main"
    if problem := hub.repo_problem(repo):
        raise ValidationError({"repo": problem})
    if problem := hub.revision_problem(revision):
        raise ValidationError({"revision": problem})
    with transaction.atomic():
        existing = StoredModel.objects.filter(repo=repo, revision=revision).first()
        if existing is not None:
            raise ValidationError({"repo": f"The store has {existing} already ({existing.get_state_display()})."})
        model = StoredModel.objects.create(repo=repo, revision=revision, created_by=_user(user))
        _download_start(model, user)
    return model


def model_retry(model: StoredModel, *, user=None) -> Job:
    """Download a failed model again: files already in the store and partial files are kept."""
    actions.RETRY.offer(roles.acting(user)).check()
    with transaction.atomic():
        model = StoredModel.objects.select_for_update(no_key=True).get(pk=model.pk)
        if model.state != ModelState.FAILED:
            raise ValidationError(f"{model} is {model.get_state_display().lower()}: only a failed download is tried again.")
        downloads.model_transition(model, to=ModelState.DOWNLOADING)
        job = _download_start(model, user)
    downloads.model_changed(model)
    return job


def model_delete(model: StoredModel, *, user=None) -> None:
    """Delete the model's record, its tree, and the store's files no other model uses."""
    actions.DELETE.offer(roles.acting(user)).check()
    with transaction.atomic():
        model = StoredModel.objects.select_for_update(no_key=True).get(pk=model.pk)
        if refusal := actions.model_delete_refusal(model):
            raise ValidationError(refusal)
        repo, commit, pk = model.repo, model.commit, model.pk
        model.delete()
    if commit:
        disk.tree_remove(repo, commit)
    disk.unused_blobs_remove(set(ModelFile.objects.exclude(sha256="").values_list("sha256", flat=True)))
    shutil.rmtree(disk.downloads_dir(pk), ignore_errors=True)
    downloads.model_changed(pk)


def _download_start(model: StoredModel, user) -> Job:
    return job_start(kind=downloads.KIND, title=f"Download {model}", target_type="model", target_id=model.pk,
                     steps=downloads.DOWNLOAD.step_names, user=user)


def _user(user):
    return user if user is not None and user.is_authenticated else None


# -- the model's files on a cluster's machines ------------------------------------------------------------------


def model_copy(model: StoredModel, cluster, *, user=None) -> Job:
    """Put the model's files on the cluster's machines (ahead of a deployment, or for one)."""
    actions.COPY.offer(roles.acting(user)).check()
    with transaction.atomic():
        model = StoredModel.objects.select_for_update(no_key=True).get(pk=model.pk)
        if model.state != ModelState.READY:
            raise ValidationError(f"{model} is {model.get_state_display().lower()}: its files are not all in the store yet.")
        if cluster.state not in (ClusterState.RUNNING, ClusterState.STOPPED):
            raise ValidationError(f"{cluster.name} is {cluster.get_state_display().lower()}: models are copied to the "
                                  "machines of a running or stopped cluster.")
        if busy := cluster_busy(cluster):
            raise ValidationError(f"{cluster.name} is busy ({busy.title}): wait for it to end.")
        if refusal := actions.agents_refusal(cluster):
            raise ValidationError(refusal)
        return job_start(kind=machine_files.KIND, title=f"Copy {model} to {cluster.name}'s machines", target_type="cluster",
                         target_id=cluster.pk, steps=machine_files.copy_operation(cluster).step_names, user=user, params={"model": model.pk})


def model_remove_from_machines(model: StoredModel, machine_ids: list[int] | None = None, *, user=None) -> Job:
    """Remove the model's files from the machines that hold them (all, or those named)."""
    actions.REMOVE.offer(roles.acting(user)).check()
    with transaction.atomic():
        held = model.holdings.all() if machine_ids is None else model.holdings.filter(machine_id__in=machine_ids)
        ids = list(held.values_list("machine_id", flat=True))
        if not ids:
            raise ValidationError(f"No machine{' of those' if machine_ids else ''} holds {model}'s files.")
        if busy := selectors.model_active_job(model):
            raise ValidationError(f"{model} has a job running ({busy.title}): wait for it to end.")
        return job_start(kind=machine_files.REMOVE_KIND, title=f"Remove {model} from {len(ids)} machine{'s' if len(ids) > 1 else ''}",
                         target_type="model", target_id=model.pk, steps=machine_files.REMOVE.step_names, user=user,
                         params={"machines": ids})
