"""The console's row locks (FOR NO KEY UPDATE) keep other lockers out but let a row that refers to the
locked one be written meanwhile. With FOR UPDATE, a health check holding its cluster while a heartbeat
held its machine deadlocked on the two key checks at commit (seen in the lab); PostgreSQL only."""
import threading

import pytest
from django.db import IntegrityError, connection, transaction

from clusters.choices import CheckTrigger
from clusters.lifecycle import cluster_locked
from clusters.models import Cluster, HealthCheck
from tests.builders import cluster_of, gpu_machine

pytestmark = [pytest.mark.django_db(transaction=True),
              pytest.mark.skipif("connection.vendor != 'postgresql'", reason="SQLite has no row locks")]


def in_thread(work, *, timeout: float, errors: list | None = None) -> bool:
    """Run ``work`` on its own connection; whether it finished within ``timeout`` seconds. An error it
    raises goes into ``errors`` when the caller expects one (else the thread fails as usual)."""
    done = threading.Event()

    def run():
        try:
            with transaction.atomic():
                work()
            done.set()
        except Exception as exc:
            if errors is None:
                raise
            errors.append(exc)
        finally:
            connection.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    finished = done.wait(timeout)
    return finished, thread


def test_a_locked_cluster_still_takes_a_health_check_but_not_a_second_locker():
    room = cluster_of([gpu_machine("lab-a", 11)])
    with transaction.atomic():
        cluster_locked(room)

        checked, _ = in_thread(lambda: HealthCheck.objects.create(cluster_id=room.pk, trigger=CheckTrigger.HEARTBEAT),
                               timeout=5)
        locker_done, locker = in_thread(lambda: cluster_locked(Cluster(pk=room.pk)), timeout=0.5)

        assert checked, "a row referring to the locked cluster waited for the lock"
        assert not locker_done, "a second locker got the cluster while it was locked"
    locker.join(5)
    assert not locker.is_alive()
    assert HealthCheck.objects.filter(cluster=room).count() == 1


def test_deleting_a_cluster_is_not_failed_by_a_health_check_written_while_it_deletes():
    """Seen in CI: a check committed between the delete's look at what refers to the cluster and its
    DELETE failed the delete on the foreign key at commit. The delete takes FOR UPDATE first, so such a
    write waits for the delete and fails on its own side (the check of a cluster that is gone)."""
    from django.db.models.signals import pre_delete

    from clusters.services import cluster_record_delete

    room = cluster_of([gpu_machine("lab-a", 11)])
    writers, refused = [], []

    def check_written_meanwhile(sender, instance, **kwargs):  # after Django collected what refers to it
        if instance.pk == room.pk and not writers:
            writers.append(in_thread(lambda: HealthCheck.objects.create(cluster_id=room.pk, trigger=CheckTrigger.HEARTBEAT),
                                     timeout=0.5, errors=refused))

    pre_delete.connect(check_written_meanwhile, sender=Cluster)
    try:
        with transaction.atomic():
            cluster_record_delete(cluster=Cluster.objects.get(pk=room.pk))
    finally:
        pre_delete.disconnect(check_written_meanwhile, sender=Cluster)
    written, writer = writers[0]
    writer.join(5)
    assert not written, "the check was written while the delete held the cluster"
    assert not Cluster.objects.filter(pk=room.pk).exists()
    assert [type(exc) for exc in refused] == [IntegrityError], refused  # it failed on its own side
