from celery import shared_task

from console.jobs import jobs_reap as jobs_reap_service
from console.pruning import old_records_prune


@shared_task
def jobs_reap() -> int:
    return jobs_reap_service()


@shared_task
def prune_old_records() -> dict[str, int]:
    return old_records_prune()
