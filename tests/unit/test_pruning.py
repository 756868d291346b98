"""Old events, finished jobs and health checks are pruned by age; what is recent or still running stays."""
from datetime import timedelta

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from clusters.choices import CheckOutcome, CheckTrigger, ClusterState
from clusters.models import Cluster, HealthCheck
from clusters.pruning import health_checks_prune
from console import pruning
from console.choices import JobState
from console.models import Job
from console.tasks import prune_old_records
from machines.choices import EventKind
from machines.models import MachineEvent
from machines.services import machine_events_prune
from tests.factories import JobFactory, MachineFactory

pytestmark = pytest.mark.django_db

NOW = timezone.now()


def days_ago(days: float):
    return NOW - timedelta(days=days)


def event(machine, days: float) -> MachineEvent:
    row = MachineEvent.objects.create(machine=machine, kind=EventKind.STATE, message=f"{days} days ago")
    MachineEvent.objects.filter(pk=row.pk).update(created_at=days_ago(days))
    return row


def job(machine, state: str, days: float) -> Job:
    row = JobFactory(target_id=machine.pk, state=state)
    finished = days_ago(days) if state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED) else None
    Job.objects.filter(pk=row.pk).update(created_at=days_ago(days), finished_at=finished)
    return row


def check(cluster, days: float, first_look=None) -> HealthCheck:
    row = HealthCheck.objects.create(cluster=cluster, trigger=CheckTrigger.SCHEDULE, outcome=CheckOutcome.HEALTHY, first_look=first_look)
    HealthCheck.objects.filter(pk=row.pk).update(started_at=days_ago(days))
    return row


def test_machine_events_older_than_the_setting_are_deleted_and_newer_ones_stay(settings):
    settings.FADEN_KEEP_EVENTS_DAYS = 30
    machine = MachineFactory()
    old, recent = event(machine, 31), event(machine, 29)

    deleted = pruning.old_records_prune(now=NOW)

    assert deleted["machine events"] == 1
    assert list(MachineEvent.objects.values_list("pk", flat=True)) == [recent.pk]
    assert not MachineEvent.objects.filter(pk=old.pk).exists()


def test_finished_jobs_older_than_the_setting_are_deleted_but_queued_and_running_ones_stay_whatever_their_age(settings):
    settings.FADEN_KEEP_JOBS_DAYS = 30
    machine = MachineFactory()
    old_done = [job(machine, state, 40) for state in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)]
    kept = [job(machine, JobState.QUEUED, 40), job(machine, JobState.RUNNING, 40), job(machine, JobState.SUCCEEDED, 10)]

    deleted = pruning.old_records_prune(now=NOW)

    assert deleted["jobs"] == len(old_done)
    assert set(Job.objects.values_list("pk", flat=True)) == {j.pk for j in kept}


def test_health_checks_older_than_the_cut_are_deleted_and_a_second_look_keeps_its_record_without_its_first():
    cluster = Cluster.objects.create(name="gpu-room", state=ClusterState.RUNNING)
    first = check(cluster, 8)
    second = check(cluster, 6, first_look=first)

    assert health_checks_prune(days_ago(7)) == 1

    second.refresh_from_db()
    assert list(HealthCheck.objects.all()) == [second]
    assert second.first_look is None


def test_a_setting_of_zero_keeps_the_records_for_ever(settings):
    settings.FADEN_KEEP_EVENTS_DAYS = 0
    machine = MachineFactory()
    event(machine, 3650)

    assert "machine events" not in pruning.old_records_prune(now=NOW)
    assert MachineEvent.objects.count() == 1


def test_a_pruner_that_fails_does_not_stop_the_others(settings, monkeypatch):
    settings.FADEN_KEEP_EVENTS_DAYS = 30
    monkeypatch.setattr(pruning, "_pruners", {})

    def broken(older_than):
        raise RuntimeError("disk on fire")

    pruning.register_pruner("broken", broken, keep_days_setting="FADEN_KEEP_EVENTS_DAYS")
    pruning.register_pruner("machine events", machine_events_prune, keep_days_setting="FADEN_KEEP_EVENTS_DAYS")
    machine = MachineFactory()
    event(machine, 31)

    deleted = pruning.old_records_prune(now=NOW)

    assert "broken" not in deleted
    assert deleted["machine events"] == 1


def test_more_rows_than_a_batch_are_all_deleted(monkeypatch):
    monkeypatch.setattr(pruning, "BATCH", 3)
    machine = MachineFactory()
    for _ in range(8):
        event(machine, 100)

    assert pruning.delete_in_batches(MachineEvent.objects.all()) == 8
    assert not MachineEvent.objects.exists()


def test_beat_runs_the_pruning_every_hour_through_the_task(settings):
    settings.FADEN_KEEP_EVENTS_DAYS = 30
    entry = django_settings.CELERY_BEAT_SCHEDULE["prune-old-records"]
    assert entry["task"] == "console.tasks.prune_old_records"
    assert entry["schedule"] == timedelta(hours=1)
    event(MachineFactory(), 31)

    assert prune_old_records.delay().get()["machine events"] == 1
