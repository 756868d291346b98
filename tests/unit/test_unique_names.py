"""Two requests that add the same name at once: both pass the check, the database keeps one, and the
other is refused with the sentence the check gives (it was an IntegrityError, a 500)."""
import threading

import pytest
from django.core.exceptions import ValidationError
from django.db import connections

from clusters import planning, services as cluster_services
from clusters.models import Cluster
from machines import remote, services as machine_services
from machines.models import Machine
from tests.builders import NETWORK, build, gpu_machine
from tests.factories import fingerprint_for

pytestmark = pytest.mark.django_db(transaction=True)


def at_once(*calls) -> list:
    """Run each call in a thread of its own (a connection of its own); what each returned or raised."""
    outcomes = [None] * len(calls)

    def run(index, call):
        try:
            outcomes[index] = call()
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcomes[index] = exc
        finally:
            connections.close_all()

    threads = [threading.Thread(target=run, args=(i, call)) for i, call in enumerate(calls)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return outcomes


def both_checked_first(monkeypatch, module, name: str):
    """``module.name`` waits until both requests reach it: each has passed the name's check by then."""
    barrier, real = threading.Barrier(2, timeout=10), getattr(module, name)

    def wait_then(*args, **kwargs):
        barrier.wait()
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wait_then)


def refusals(outcomes) -> list[str]:
    return [" ".join(outcome.messages) for outcome in outcomes if isinstance(outcome, ValidationError)]


def test_two_machines_added_with_one_name_at_once_make_one_machine_and_the_usual_refusal(monkeypatch):
    monkeypatch.setattr(remote, "scan_host_key", lambda address, port: fingerprint_for(address))
    both_checked_first(monkeypatch, machine_services, "machine_host_key_scan")

    outcomes = at_once(lambda: machine_services.machine_create(name="gpu-01", address="198.18.0.11"),
                       lambda: machine_services.machine_create(name="gpu-01", address="198.18.0.12"))

    assert Machine.objects.filter(name="gpu-01").count() == 1
    assert sum(isinstance(outcome, Machine) for outcome in outcomes) == 1
    assert refusals(outcomes) == ["Machine with this Name already exists."]


def test_two_clusters_created_with_one_name_at_once_make_one_cluster_and_the_usual_refusal(monkeypatch):
    monkeypatch.setattr("console.jobs.task_enqueue", lambda *args, **kwargs: None)  # no start runs
    build("2.1.0")
    first, second = gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)
    both_checked_first(monkeypatch, planning, "shared_networks")

    def create(machine):
        return lambda: cluster_services.cluster_create(name="gpu-room", machine_ids=[machine.pk], head_id=None, network=NETWORK)

    outcomes = at_once(create(first), create(second))

    assert Cluster.objects.filter(name="gpu-room").count() == 1
    assert sum(isinstance(outcome, Cluster) for outcome in outcomes) == 1
    assert refusals(outcomes) == ["There is already a cluster named gpu-room; pick another name."]
