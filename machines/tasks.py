"""Thin tasks: load by primary key, call a service."""
from celery import shared_task

from console.jobs import job_run
from console.models import Job
from machines import agent_update, enrolment, services


def _push_job(job: Job) -> None:
    services.live.push(f"machine:{job.target_id}", part="job")  # the job's card only: steps come often


@shared_task(acks_late=True)
def machine_enrol(job_id: int) -> None:
    job = Job.objects.get(pk=job_id)
    job_run(job_id, lambda ctx: enrolment.machine_enrol_run(ctx, machine_id=job.target_id), on_change=_push_job)


@shared_task(acks_late=True)
def machine_update_agent(job_id: int) -> None:
    job = Job.objects.get(pk=job_id)
    job_run(job_id, lambda ctx: agent_update.machine_update_agent_run(ctx, machine_id=job.target_id), on_change=_push_job)


@shared_task
def machines_mark_offline() -> int:
    return len(services.machines_mark_offline())
