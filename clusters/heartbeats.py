"""Checks a machine's heartbeat starts and confirms: failures seen within a beat.

Each heartbeat says what the machine's runtime and Ray are doing (machines/beats.py). When one
reports a failure the checks have not seen yet (Ray that was running there is gone, the runtime's
container stopped) on a member of a running cluster, that cluster is checked at once, through the
one check path (``health.cluster_check_run``, in a task), and that check is the first look. Its
second look is cued by the same machine's next heartbeat instead of the 20 s timer: whether that
beat still reports the failure or says it is up again, the second look runs as soon as it arrives
and decides as every second look does (a repair when the failure is still there; all well, and the
machine Up again, after a blip). Still two looks. The timer stays behind it for a beat that never
comes (``health.beat_confirm_countdown``); scheduled and other checks keep their own 20 s.

Storms: a heartbeat starts no check while one of the cluster is Looking; a failure starts one only
when no check began since the machine's beats began to report it (``failing_since``); and the rows
are written here, in the heartbeat's transaction, with the cluster's row locked, so that the
machines of one cluster beating at once start one check between them.
"""
from __future__ import annotations

from datetime import datetime, timedelta

from django.utils import timezone

from clusters import health, selectors, services
from clusters.choices import CHECKED, CheckOutcome, CheckTrigger
from clusters.lifecycle import cluster_locked
from clusters.models import Cluster, ClusterMember, HealthCheck
from console.jobs import task_enqueue


def cluster_heartbeat_runtime(*, machine_id: int, name: str, failure: str, failing_since: datetime | None) -> HealthCheck | None:
    """A member's heartbeat said something about its runtime (machines.signals.machine_runtime_reported):
    the second look of the check it started, or a new check, or nothing. Called inside the heartbeat's
    transaction; the check itself runs in a task after commit. Returns the check written, if any."""
    member = ClusterMember.objects.select_related("cluster").filter(machine_id=machine_id).first()
    if member is None or member.cluster.state not in CHECKED:
        return None
    cluster = cluster_locked(member.cluster)
    if cluster.state not in CHECKED or selectors.cluster_busy(cluster):
        return None  # a repair or another operation is under way: it is what changed the runtime
    in_flight = timezone.now() - timedelta(seconds=health.check_slowest())
    if cluster.health_checks.filter(outcome=CheckOutcome.RUNNING, started_at__gt=in_flight).exists():
        return None  # one check at a time: the one Looking now has its own second look
    latest = cluster.health_checks.first()
    if latest is not None and _awaits_beat_of(latest, machine_id):
        said = f"{name}'s next heartbeat still says: {failure}" if failure else f"{name}'s next heartbeat says it is up again"
        return _check_queue(cluster, CheckTrigger.SECOND_LOOK, said, first_look=latest)
    if failure and failing_since is not None and (latest is None or latest.started_at < failing_since):
        return _check_queue(cluster, CheckTrigger.HEARTBEAT, f"from {name}: {failure}", beat_machine_id=machine_id)
    return None


def _awaits_beat_of(check: HealthCheck, machine_id: int) -> bool:
    """The cluster's latest check is a first look this machine's heartbeat started, waiting for its next."""
    return (check.trigger == CheckTrigger.HEARTBEAT and check.outcome == CheckOutcome.LOOK_AGAIN
            and check.beat_machine_id == machine_id)


def _check_queue(cluster: Cluster, trigger: str, detail: str, *, first_look: HealthCheck | None = None,
                 beat_machine_id: int | None = None) -> HealthCheck:
    """Write the check, Looking, and send it to the check task after commit (the page shows it at once)."""
    check = HealthCheck.objects.create(cluster=cluster, trigger=trigger, trigger_detail=detail[:200], first_look=first_look,
                                       beat_machine_id=beat_machine_id)
    task_enqueue(services.CHECK_TASK, cluster.pk, trigger, check.trigger_detail, first_look.pk if first_look else None, check.pk)
    health.checks_changed(cluster)
    return check
