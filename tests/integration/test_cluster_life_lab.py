"""A cluster's life on the lab, with a real worker and a real beat at shortened intervals: stop,
start and delete; machines added; Ray killed, links cut and the head powered off, and the
console noticing, looking twice and repairing by itself; a worker killed in the middle of a start."""
import subprocess
import sys
from pathlib import Path

import pytest

from clusters import images, services
from clusters.choices import CheckOutcome, ClusterState, MemberState
from clusters.models import Cluster, HealthCheck
from console.models import Job
from machines import remote
from machines.choices import MachineState
from machines.models import Machine
from machines.services import machine_create, machine_target
from tests.lab_fixtures import lab_fault
from tests.lab_cluster import FABRIC, IMAGE_MIB, INTERVALS, all_up, cluster_in, running, wait_for
from tests.processes import console_processes

pytestmark = [pytest.mark.lab, pytest.mark.django_db(transaction=True)]

@pytest.fixture
def console(lab, lab_dir):
    with console_processes(beat=True, env=INTERVALS, enqueue=True) as processes:
        yield processes


@pytest.fixture
def lab_images(lab_dir):
    out = f"{lab_dir}/images"
    built = subprocess.run([sys.executable, "-m", "lab", "images", "--size-mib", str(IMAGE_MIB), "--out", out],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return [images.runtime_image_import(path=Path(line.split()[-1])) for line in built.stdout.splitlines()
            if line.strip().endswith(".img")]


@pytest.fixture
def enrolled(console, lab_machine, lab_images):
    """Enrol the named machines through the worker; afterwards power them on and leave nothing running."""
    names: list[str] = []

    def enrol(*wanted):
        for name in wanted:
            spec = lab_machine(name)
            machine_create(name=name, address=spec["address"], ssh_port=22, ssh_user="root",
                           host_key_fingerprint=spec["host_key_fingerprint"])
            names.append(name)
        machines = [wait_for(lambda n=n: Machine.objects.filter(name=n, state=MachineState.HEALTHY).first(),
                             timeout=60, what=f"{n} to enrol") for n in wanted]
        return machines

    yield enrol
    for name in names:
        lab_fault(name, "power-on")
        lab_fault(name, "link-up", "fabric")
    for machine in Machine.objects.filter(name__in=names):
        with remote.connect(machine_target(machine)) as conn:
            remote.run_agent(conn, machine.agent_command("runtime", "stop"), timeout=60)
            remote.run_agent(conn, machine.agent_command("image", "serve", "stop"), timeout=60)
            remote.run(conn, ["rm", "-rf", "/var/lib/fadenstack/blobs", "/var/lib/fadenstack/images",
                              "/var/lib/fadenstack/runtime"])


def ray_runs_on(machine: Machine) -> bool:
    with remote.connect(machine_target(machine)) as conn:
        return remote.run_agent(conn, machine.agent_command("runtime", "status"), timeout=30)["ray"]["running"]


def test_stop_frees_the_machines_start_brings_it_back_and_delete_leaves_them_enrolled(enrolled):
    a, b = enrolled("lab-a", "lab-b")
    cluster = running("life", [a, b])

    services.cluster_stop(cluster=cluster)
    cluster = wait_for(lambda: cluster_in("life", ClusterState.STOPPED), timeout=60, what="Stopped")
    assert set(cluster.members.values_list("state", flat=True)) == {MemberState.STOPPED}
    assert not ray_runs_on(a) and not ray_runs_on(b)
    assert cluster.network == FABRIC and cluster.members.count() == 2

    services.cluster_start(cluster=cluster)
    wait_for(lambda: all_up("life", 2), timeout=120, what="Running again with both machines")
    assert ray_runs_on(a) and ray_runs_on(b)

    job = services.cluster_delete(cluster=Cluster.objects.get(name="life"))
    assert job is not None  # a running cluster is stopped first
    wait_for(lambda: not Cluster.objects.filter(name="life").exists(), timeout=60, what="the cluster to go")
    assert not ray_runs_on(a) and not ray_runs_on(b)
    assert Machine.objects.filter(pk__in=[a.pk, b.pk], membership__isnull=True, state=MachineState.HEALTHY).count() == 2


def test_ray_killed_on_a_worker_is_joined_again_while_the_head_keeps_running(enrolled):
    a, b, c = enrolled("lab-a", "lab-b", "lab-c")
    running("rejoin", [a, b, c])

    lab_fault("lab-b", "ray-kill")

    down = wait_for(lambda: Cluster.objects.get(name="rejoin").members.filter(machine__name="lab-b", state__in=[
        MemberState.DOWN, MemberState.REJOINING]).first(), timeout=30, what="the console to notice")
    assert "lab-b" in down.state_reason
    cluster = wait_for(lambda: all_up("rejoin", 3), timeout=90, what="lab-b back in Ray")
    assert cluster.members.get(machine__name="lab-a").state == MemberState.JOINED
    outcomes = list(HealthCheck.objects.filter(cluster=cluster).order_by("started_at").values_list("outcome", flat=True))
    assert CheckOutcome.LOOK_AGAIN in outcomes and CheckOutcome.REPAIR in outcomes
    assert outcomes.index(CheckOutcome.LOOK_AGAIN) < outcomes.index(CheckOutcome.REPAIR)  # it looked twice
    assert not Job.objects.filter(target_id=cluster.pk, kind="cluster.start", title__startswith="Restart").exists()
    assert ray_runs_on(b)


def test_ray_killed_on_the_head_restarts_the_cluster(enrolled):
    a, b = enrolled("lab-a", "lab-b")
    running("head", [a, b])

    lab_fault("lab-a", "ray-kill")

    wait_for(lambda: "Restarting the cluster (attempt 1 of 3)" in (cluster_in("head", ClusterState.STARTING) or Cluster()).state_reason,
             timeout=40, what="the restart to begin")
    cluster = wait_for(lambda: all_up("head", 2), timeout=120, what="Running again after the restart")
    assert cluster.restart_attempt == 0
    assert HealthCheck.objects.filter(cluster=cluster, outcome=CheckOutcome.REPAIR, action__contains="attempt 1 of 3").exists()


def test_the_head_powered_off_reads_failed_after_three_restarts_and_comes_back_after_power_on(enrolled):
    a, b = enrolled("lab-a", "lab-b")
    running("power", [a, b])

    lab_fault("lab-a", "power-off")
    failed = wait_for(lambda: cluster_in("power", ClusterState.FAILED), timeout=180, what="Failed")
    assert "after 3 restarts" in failed.state_reason and "Try again" in failed.state_reason
    restarts = Job.objects.filter(target_id=failed.pk, kind="cluster.start", title__startswith="Restart").count()
    assert restarts == 3

    lab_fault("lab-a", "power-on")
    wait_for(lambda: all_up("power", 2), timeout=180, what="Running again after power-on")


def test_a_worker_whose_fabric_link_went_down_is_repaired_once_it_is_back(enrolled):
    a, b = enrolled("lab-a", "lab-b")
    running("link", [a, b])

    lab_fault("lab-b", "link-down", "fabric")
    try:
        wait_for(lambda: Cluster.objects.get(name="link").members.filter(machine__name="lab-b", state__in=[
            MemberState.DOWN, MemberState.FAILED]).exists(), timeout=120, what="lab-b out of the cluster")
        assert Cluster.objects.get(name="link").state == ClusterState.RUNNING  # the head keeps serving
    finally:
        lab_fault("lab-b", "link-up", "fabric")
    wait_for(lambda: all_up("link", 2), timeout=120, what="lab-b back after the link came up")


def test_a_machine_added_to_a_running_cluster_gets_the_image_from_the_cluster_and_joins(enrolled):
    a, b, c = enrolled("lab-a", "lab-b", "lab-c")
    cluster = running("grow", [a, b])
    before = sum(cluster.members.values_list("accelerators_in_ray", flat=True))

    services.cluster_add_machines(cluster=cluster, machine_ids=[c.pk])

    cluster = wait_for(lambda: all_up("grow", 3), timeout=120, what="lab-c to join")
    added = cluster.members.get(machine=c)
    assert added.image_transfer.source.startswith(("lab-a", "lab-b"))  # from a machine of the cluster, not the server
    assert sum(cluster.members.values_list("accelerators_in_ray", flat=True)) == before + added.accelerators_in_ray > before


def test_a_cluster_whose_machines_are_all_offline_is_deleted_anyway_and_its_leftovers_are_replaced(enrolled):
    (c,) = enrolled("lab-c")
    cluster = running("gone", [c])

    lab_fault("lab-c", "power-off")
    wait_for(lambda: Machine.objects.filter(pk=c.pk, state=MachineState.OFFLINE).exists(), timeout=40, what="lab-c offline")
    assert services.cluster_delete(cluster=Cluster.objects.get(pk=cluster.pk)) is None
    assert not Cluster.objects.filter(pk=cluster.pk).exists()

    lab_fault("lab-c", "power-on")
    wait_for(lambda: Machine.objects.filter(pk=c.pk, state=MachineState.HEALTHY).exists(), timeout=40, what="lab-c back")
    running("again", [c])


def test_the_worker_killed_in_the_middle_of_a_start_is_replaced_and_the_start_still_reaches_running(enrolled, console):
    a, b = enrolled("lab-a", "lab-b")
    services.cluster_create(name="crash", machine_ids=[a.pk, b.pk], head_id=a.pk, network=FABRIC)
    job = wait_for(lambda: Job.objects.filter(kind="cluster.start", state="running", steps__1__state="running").first()
                   or Job.objects.filter(kind="cluster.start", state="running", steps__2__state="running").first(),
                   timeout=60, what="the start to reach its second step", every=0.1)

    console.kill_worker()
    console.start_worker()

    cluster = wait_for(lambda: all_up("crash", 2), timeout=180, what="Running after the worker was replaced")
    job = wait_for(lambda: Job.objects.filter(pk=job.pk).exclude(state="running").first(), timeout=30, what="the job to end")
    assert job.state == "succeeded" and job.resumes == 1
    assert "Taken up again where it stopped" in job.log
    assert [s["state"] for s in job.steps] == ["done"] * len(job.steps)
    for member in cluster.members.all():  # the image crossed the network once, not once per run
        assert member.image_transfer.bytes_fetched <= member.runtime_image.size_bytes + member.runtime_image.chunk_size
