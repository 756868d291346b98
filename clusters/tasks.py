"""Thin tasks: load by primary key, call a service."""
from celery import shared_task

from clusters import probing, services, starting
from console.jobs import job_run
from console.models import Job
from console import live


@shared_task(acks_late=True)
def cluster_start(job_id: int) -> None:
    job = Job.objects.get(pk=job_id)
    job_run(
        job_id,
        lambda ctx: starting.cluster_start_run(ctx, cluster_id=job.target_id),
        on_change=lambda j: live.push(f"cluster:{j.target_id}", part="job"),
    )


@shared_task(acks_late=True)
def network_probe(job_id: int) -> None:
    job_run(job_id, probing.network_probe_run, on_change=lambda j: live.push(f"probe:{j.pk}"))


@shared_task
def clusters_retry_due() -> int:
    return len(services.clusters_retry_due())
