"""Thin tasks: load by primary key, call a service."""
from celery import shared_task

from clusters import health, probing, services, starting, stopping
from console import live
from console.jobs import job_run
from console.models import Job

# Every operation on a cluster is a job of one of these kinds, run by ``cluster_job``.
RUNNERS = {
    services.START_KIND: starting.cluster_start_run,
    services.ADD_KIND: starting.cluster_add_run,
    services.REJOIN_KIND: starting.cluster_rejoin_run,
    services.STOP_KIND: stopping.cluster_stop_run,
    services.DELETE_KIND: stopping.cluster_delete_run,
}


@shared_task(acks_late=True)
def cluster_job(job_id: int) -> None:
    job = Job.objects.get(pk=job_id)
    run = RUNNERS[job.kind]
    job_run(
        job_id,
        lambda ctx: run(ctx, cluster_id=job.target_id),
        on_change=lambda j: live.push(f"cluster:{j.target_id}", part="job"),
    )




@shared_task(acks_late=True)
def network_probe(job_id: int) -> None:
    job_run(job_id, probing.network_probe_run, on_change=lambda j: live.push(f"probe:{j.pk}"))


@shared_task
def clusters_retry_due() -> int:
    return len(services.clusters_retry_due())


@shared_task
def clusters_check() -> int:
    """Every minute (beat): a check of every running cluster, each in a task of its own."""
    return len(health.clusters_check_due())


@shared_task
def cluster_check(cluster_id: int, trigger: str, detail: str = "", first_look_id: int | None = None) -> None:
    health.cluster_check_run(cluster_id=cluster_id, trigger=trigger, detail=detail, first_look_id=first_look_id)
