"""A lab cluster with a real worker and beat at shortened intervals, and polling the database for what
the page would show: shared by the lab tests of a cluster's life and by bench/faults.py."""
import time

import pytest

from clusters import services
from clusters.choices import ClusterState, MemberState
from clusters.models import Cluster
from console.models import Job

FABRIC = "198.18.1.0/24"
IMAGE_MIB = 48
# Every interval shortened, so that a minute of the product is seconds here.
INTERVALS = {
    "FADEN_HEALTH_INTERVAL": "4",
    "FADEN_HEALTH_LOOK_AGAIN": "3",
    "FADEN_RESTART_PAUSE": "2",
    "FADEN_FAILED_RETRY": "3600",  # the test powers the head on instead of waiting for the 15-minute retry
    "FADEN_RETRY_TICK": "2",
    "FADEN_JOB_BEAT": "2",
    "FADEN_JOB_STALE": "8",
    "FADEN_JOB_REAP_TICK": "3",
    "FADEN_HEARTBEAT_INTERVAL": "3",
    "FADEN_OFFLINE_AFTER": "10",
}


def wait_for(condition, *, timeout: float, what: str, every: float = 0.5):
    """Poll the database (the truth the page shows) until ``condition`` holds; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s for {what}; meanwhile:\n{what_happened()}")
        time.sleep(every)


def what_happened() -> str:
    lines = []
    for cluster in Cluster.objects.all():
        lines.append(f"{cluster.name}: {cluster.state} {cluster.state_reason!r}")
        lines += [f"  {m.machine.name}: {m.state} {m.state_reason!r}" for m in cluster.members.select_related("machine")]
        lines += [f"  check {c.outcome}: {c.action}" for c in cluster.health_checks.all()[:5]]
    for job in Job.objects.order_by("-pk")[:6]:
        lines.append(f"job {job.kind} {job.title} {job.state} {job.error!r} steps={[s['state'] for s in job.steps]}\n{job.log[-800:]}")
    return "\n".join(lines)


def cluster_in(name: str, *states: str):
    cluster = Cluster.objects.filter(name=name).first()
    return cluster if cluster and cluster.state in states else None


def running(name: str, machines, timeout: float = 180) -> Cluster:
    services.cluster_create(name=name, machine_ids=[m.pk for m in machines], head_id=machines[0].pk, network=FABRIC)
    return wait_for(lambda: cluster_in(name, ClusterState.RUNNING), timeout=timeout, what=f"{name} to run")


def all_up(name: str, count: int):
    cluster = cluster_in(name, ClusterState.RUNNING)
    if cluster and not cluster.state_reason and cluster.members.filter(state=MemberState.JOINED).count() == count:
        return cluster
    return None
