"""Thin tasks: load by primary key, run the job's body."""
from celery import shared_task

from clusters.lifecycle import cluster_changed

from console import live
from console.jobs import job_run
from console.models import Job
from deployments import copy_health, drain, drain_job, gateway_usage, orphans, rollout, serving
from deployments.store import downloads, machine_files, sources


@shared_task(acks_late=True)
def model_download(job_id: int) -> None:
    job = Job.objects.get(pk=job_id)
    job_run(job_id, lambda ctx: downloads.model_download_run(ctx, model_id=job.target_id),
            on_change=lambda j: downloads.model_changed(j.target_id, part="job"))


@shared_task(acks_late=True)
def model_copy(job_id: int) -> None:
    """A model's files to a cluster's machines: the cluster's page shows the job and the bars."""
    job = Job.objects.get(pk=job_id)
    model_id = job.params["model"]

    def changed(j: Job) -> None:
        cluster_changed(j.target_id, part="job")
        downloads.model_changed(model_id, part="job")

    job_run(job_id, lambda ctx: machine_files.model_copy_run(ctx, cluster_id=job.target_id, model_id=model_id), on_change=changed)


@shared_task(acks_late=True)
def model_remove(job_id: int) -> None:
    job = Job.objects.get(pk=job_id)
    job_run(job_id, lambda ctx: machine_files.model_remove_run(ctx, model_id=job.target_id, machine_ids=job.params["machines"]),
            on_change=lambda j: downloads.model_changed(j.target_id, part="job"))


@shared_task(acks_late=True)
def model_source_check(job_id: int) -> None:
    """Every machine of a cluster asked to reach the hub; the whole page follows (the card shows the outcome)."""
    job = Job.objects.get(pk=job_id)
    job_run(job_id, lambda ctx: sources.model_source_check_run(ctx, cluster_id=job.target_id, switch=bool(job.params.get("switch"))),
            on_change=lambda j: cluster_changed(j.target_id))


@shared_task(acks_late=True)
def deployment_apply(job_id: int) -> None:
    """A deployment's copies brought to what is wanted: files, engines, Serving."""
    job = Job.objects.get(pk=job_id)
    job_run(job_id, lambda ctx: rollout.apply_run(ctx, deployment_id=job.target_id),
            on_change=lambda j: serving.deployment_changed(j.target_id))


@shared_task(acks_late=True)
def deployment_delete(job_id: int) -> None:
    job = Job.objects.get(pk=job_id)
    job_run(job_id, lambda ctx: serving.delete_run(ctx, deployment_id=job.target_id),
            on_change=lambda j: serving.deployment_changed(j.target_id))


@shared_task(acks_late=True)
def machine_drain(job_id: int) -> None:
    """A machine's drain: its copies move (make before break) or stop as agreed; Drained; with Remove, it leaves."""
    job = Job.objects.get(pk=job_id)
    drain_id = job.params.get("drain")

    def changed(j: Job) -> None:
        row = drain.Drain.objects.filter(pk=drain_id).values_list("cluster_id", flat=True).first()
        live.push(f"machine:{j.target_id}", part="job")
        if row:
            cluster_changed(row, part="job")

    job_run(job_id, lambda ctx: drain_job.drain_run(ctx, drain_id=drain_id), on_change=changed)


@shared_task(acks_late=True)
def orphans_look(job_id: int) -> None:
    """Look for them: every machine of the cluster asked which engines it runs; the cluster's card follows."""
    job = Job.objects.get(pk=job_id)
    job_run(job_id, lambda ctx: orphans.orphans_look_run(ctx, cluster_id=job.target_id),
            on_change=lambda j: orphans.orphans_changed(j.target_id))


@shared_task(acks_late=True)
def orphan_take(job_id: int) -> None:
    """Take over a model running without a deployment: keep it, or delete it properly."""
    job = Job.objects.get(pk=job_id)
    job_run(job_id, lambda ctx: orphans.orphan_take_run(ctx, cluster_id=job.target_id, name=job.params["name"],
                                                        keep=bool(job.params.get("keep"))),
            on_change=lambda j: orphans.orphans_changed(j.target_id))


@shared_task(acks_late=True)
def copy_look(copy_id: int, look: int, unwell_since: float | None) -> str:
    """A look at one copy (a later look restarts it if it is still unwell)."""
    return copy_health.copy_look(copy_id, look=look, unwell_since=unwell_since)


@shared_task
def gateway_failures() -> int:
    """Take the gateway's reports of copies it could not reach; each is looked at twice, then restarted."""
    return copy_health.gateway_failures()


@shared_task
def gateway_usage_copy() -> int:
    """The keys' usage the gateways counted in Redis since the last run, written to the database by the hour."""
    return gateway_usage.usage_copy()
