"""Thin tasks: load by primary key, call a runner or a service."""
from celery import shared_task

from clusters import encryption, health, leftovers, node_leave, node_logins, services
from clusters.models import Cluster
from clusters.runners import RUNNERS
from clusters.runners.firewall import firewall_refresh
from clusters.runners.nccl import nccl_test_run
from clusters.runners.probe import network_probe_run
from console import live
from console.jobs import job_run
from console.models import Job


@shared_task(acks_late=True)
def cluster_job(job_id: int) -> None:
    """Every operation on a cluster: a job of one of the kinds in ``RUNNERS``."""
    job = Job.objects.get(pk=job_id)
    run = RUNNERS[job.kind]
    job_run(
        job_id,
        lambda ctx: run(ctx, cluster_id=job.target_id),
        on_change=lambda j: live.push(f"cluster:{j.target_id}", part="job"),
    )


@shared_task(acks_late=True)
def network_probe(job_id: int) -> None:
    job_run(job_id, network_probe_run, on_change=lambda j: live.push(f"probe:{j.pk}"))


@shared_task
def nccl_test(job_id: int) -> None:
    """The NCCL test: a job of the test's row (it pushes its own card), not one of the cluster's operations."""
    job_run(job_id, lambda ctx: nccl_test_run(ctx, test_id=ctx.job.target_id), on_change=lambda job: None)


def _push_machine_job(job: Job) -> None:
    live.push(f"machine:{job.target_id}", part="job")


@shared_task(acks_late=True)
def machine_images_free(job_id: int) -> None:
    """Free the runtime images deleted clusters left on a machine: the machine's page shows the job."""
    job_run(job_id, lambda ctx: leftovers.machine_images_free_run(ctx, machine_id=ctx.job.target_id),
            on_change=_push_machine_job)


@shared_task(acks_late=True)
def machine_shared_free(job_id: int) -> None:
    """Empty the /shared a deleted cluster left on its former head."""
    job_run(job_id, lambda ctx: leftovers.machine_shared_free_run(ctx, machine_id=ctx.job.target_id),
            on_change=_push_machine_job)


@shared_task
def clusters_retry_due() -> int:
    return len(services.clusters_retry_due())


@shared_task
def clusters_check() -> int:
    """Every minute (beat): a check of every running cluster, each in a task of its own."""
    return len(health.clusters_check_due())


@shared_task
def cluster_check(cluster_id: int, trigger: str, detail: str = "", first_look_id: int | None = None,
                  check_id: int | None = None) -> None:
    """Every check: scheduled, asked for, after a start, a machine that reconnected or went offline, a heartbeat."""
    health.cluster_check_run(cluster_id=cluster_id, trigger=trigger, detail=detail, first_look_id=first_look_id,
                             check_id=check_id)


@shared_task
def cluster_firewall_refresh(cluster_id: int) -> int:
    """The members changed outside a job (a machine left the record, a move to another network): they get
    their firewall tables again as the members are now."""
    return len(firewall_refresh(cluster_id=cluster_id))


@shared_task
def node_revocations_push(cluster_id: int) -> None:
    """A node login was taken back: the cluster's revocation list to every member that answers, at once."""
    cluster = Cluster.objects.filter(pk=cluster_id).first()
    if cluster is not None:
        node_logins.revocations_push(cluster)


@shared_task
def machine_came_back(machine_id: int) -> None:
    """An Offline machine beats again: what it owes of a cluster it left goes; its cluster's revocation list,
    should it have missed one."""
    node_leave.owed_settle(machine_id)
    node_logins.revocations_push_machine(machine_id)


@shared_task
def certificates_renew() -> int:
    """Every hour (beat): clusters whose certificates have a third of their life left are renewed."""
    return len(encryption.certificates_renew_due())
