"""Every page, API call and live render makes as many queries at 30 machines as at 5: no query per row.

The counts are compared between two sizes of the same world rather than held to fixed numbers, so a
page may gain or lose a query as it changes; what fails is a query per machine, member, event or check.
bench/pages.py measures the time at 1,000 machines.
"""
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from clusters.choices import CheckOutcome, CheckTrigger, ClusterState, MemberState, Role
from clusters.models import Cluster, ClusterMember, HealthCheck, NetworkMeasurement, RuntimeImage
from console import live, roles
from console.choices import JobState
from console.models import Job
from machines.choices import EventKind, InterfaceKind, MachineState
from machines.models import Accelerator, Machine, MachineEvent, NetworkInterface

pytestmark = pytest.mark.django_db

SMALL, LARGE = 5, 30


@dataclass
class World:
    cluster: int  # a running cluster: 2 machines in the small world, 7 in the large one
    machine: int  # one of its workers, with one event and one check per machine of the world
    picked: list[int]  # two free machines the wizard ticks


def build(n: int) -> World:
    """``n`` machines with 8 GPUs and two networks each; n // 10 clusters (at least one) of n // 4 machines
    (at least two), the first running; the rest free. Events, jobs and checks grow with ``n`` too."""
    now = timezone.now()
    image = RuntimeImage.objects.create(name="NVIDIA x86_64 Runtime", version="2.1.0", digest="ab" * 32, size_bytes=2 << 30,
                                        chunk_hashes=["cd" * 32] * 256, arch="x86_64", accelerator_vendor="nvidia", path="/images/a.img")
    machines = Machine.objects.bulk_create(
        Machine(name=f"gpu-{i:02d}", address=f"198.18.0.{i + 1}", arch="x86_64", state=MachineState.HEALTHY, last_seen=now,
                facts={"arch": "x86_64", "interfaces": [], "accelerators": []}, container_runtime="docker",
                container_runtime_version="27.3.1", container_runtimes=[{"name": "docker", "version": "27.3.1"}])
        for i in range(n))
    Accelerator.objects.bulk_create(Accelerator(machine=m, index=k, vendor="nvidia", model="NVIDIA H100 80GB HBM3", memory_mib=81559)
                                    for m in machines for k in range(8))
    NetworkInterface.objects.bulk_create(
        NetworkInterface(machine=m, name=name, kind=InterfaceKind.PHYSICAL, addresses=[f"198.18.{net}.{i + 1}/24"],
                         speed_mbps=100000, default_route=net == 0, management=net == 0)
        for i, m in enumerate(machines) for net, name in ((0, "eth0"), (1, "eth1")))
    size, clusters = max(2, n // 4), max(1, n // 10)
    for c in range(clusters):
        group = machines[c * size:(c + 1) * size]
        running = c == 0
        cluster = Cluster.objects.create(name=f"room-{c}", state=ClusterState.RUNNING if running else ClusterState.STOPPED,
                                         network="198.18.1.0/24", last_status={"agents": {m.name: {} for m in group}})
        ClusterMember.objects.bulk_create(
            ClusterMember(cluster=cluster, machine=m, role=Role.HEAD if k == 0 else Role.WORKER, address=f"198.18.1.{m.pk}",
                          state=MemberState.JOINED if running else MemberState.STOPPED, runtime_image=image,
                          accelerators_in_ray=8 if running else 0, last_status={"runtime": {"digest": "sha256:" + image.digest}})
            for k, m in enumerate(group))
        NetworkMeasurement.objects.bulk_create(NetworkMeasurement(subnet="198.18.1.0/24", source=group[0], target=m, mbps=90000)
                                               for m in group[1:])
        HealthCheck.objects.bulk_create(HealthCheck(cluster=cluster, trigger=CheckTrigger.SCHEDULE, outcome=CheckOutcome.HEALTHY,
                                                    looked_at=["Ray on the head"], finished_at=now) for _ in range(n))
        Job.objects.bulk_create(Job(kind="cluster.start", title=f"Start {cluster.name}", target_type="cluster", target_id=cluster.pk,
                                    state=JobState.SUCCEEDED) for _ in range(n // 5 + 1))
    MachineEvent.objects.bulk_create(MachineEvent(machine=m, kind=EventKind.STATE, message="Healthy.") for m in machines for _ in range(n))
    Job.objects.bulk_create(Job(kind="machine.enrol", title=f"Enrol {m.name}", target_type="machine", target_id=m.pk,
                                state=JobState.SUCCEEDED, finished_at=now - timedelta(minutes=1)) for m in machines)
    first = Cluster.objects.get(name="room-0")
    members = list(first.members.order_by("machine__name").values_list("machine_id", flat=True))
    return World(cluster=first.pk, machine=members[1], picked=[m.pk for m in machines[clusters * size:]][:2])


def clear() -> None:
    for model in (HealthCheck, NetworkMeasurement, Cluster, Job, Machine, RuntimeImage):
        model.objects.all().delete()


def requests(w: World) -> dict[str, dict]:
    picked = ",".join(map(str, w.picked))
    wizard = f"/clusters/new/?name=new-room&machines={picked}"
    api = {"HTTP_ACCEPT": "application/json"}
    return {
        "dashboard": {"url": "/"},
        "machines list": {"url": "/machines/"},
        "machine page": {"url": f"/machines/{w.machine}/"},
        "clusters list": {"url": "/clusters/"},
        "cluster page": {"url": f"/clusters/{w.cluster}/"},
        "wizard machine step": {"url": f"{wizard}&step=machines"},
        "wizard machine step, htmx": {"url": f"{wizard}&step=machines", "headers": {"HTTP_HX_REQUEST": "true"}},
        "wizard network step": {"url": f"{wizard}&step=network&head={w.picked[0]}"},
        "add machines": {"url": f"/clusters/{w.cluster}/add/"},
        "change the network": {"url": f"/clusters/{w.cluster}/network/"},
        "api machines": {"url": "/api/machines/", "headers": api},
        "api machine": {"url": f"/api/machines/{w.machine}/", "headers": api},
        "api clusters": {"url": "/api/clusters/", "headers": api},
        "api cluster": {"url": f"/api/clusters/{w.cluster}/", "headers": api},
        "api join candidates": {"url": f"/api/clusters/{w.cluster}/join-candidates/", "headers": api},
        "api health checks": {"url": f"/api/clusters/{w.cluster}/health-checks/", "headers": api},
        "api networks": {"url": f"/api/clusters/networks/?machines={picked}", "headers": api},
        "live machines": {"topic": "machines"},
        "live machines row": {"topic": "machines", "part": str(w.machine)},
        "live machine": {"topic": f"machine:{w.machine}"},
        "live clusters": {"topic": "clusters"},
        "live cluster": {"topic": f"cluster:{w.cluster}"},
        "live cluster members": {"topic": f"cluster:{w.cluster}", "part": "members"},
        "live cluster job": {"topic": f"cluster:{w.cluster}", "part": "job"},
        "live cluster checks": {"topic": f"cluster:{w.cluster}", "part": "checks"},
    }


def queries_of(client, how: dict) -> list[str]:
    """The SQL one request or render runs (a wrapper: a request's start empties connection.queries)."""
    sql = []

    def record(execute, statement, params, many, context):
        sql.append(statement)
        return execute(statement, params, many, context)

    with connection.execute_wrapper(record):
        if "topic" in how:
            assert live.render_topic(how["topic"], how.get("part", ""), roles.ADMINISTRATOR)
        else:
            response = client.get(how["url"], **how.get("headers", {}))
            assert response.status_code == 200, response.content[:300]
    return sql


@pytest.mark.parametrize("name", list(requests(World(0, 0, [0, 0]))))
def test_a_page_makes_as_many_queries_at_30_machines_as_at_5(admin_client, name):
    how = requests(build(SMALL))[name]
    queries_of(admin_client, how)  # once to warm what is loaded once per process
    small = queries_of(admin_client, how)
    clear()
    large = queries_of(admin_client, requests(build(LARGE))[name])

    assert len(large) == len(small), "\n".join(
        [f"{name}: {len(small)} queries at {SMALL} machines, {len(large)} at {LARGE}:"] + [s[:160] for s in large])
