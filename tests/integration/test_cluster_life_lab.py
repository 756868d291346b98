"""A cluster's life on the lab, with a real worker and a real beat at shortened intervals: a worker
killed in the middle of a start; the NCCL test; a model deployed in the runtime containers, called
through the gateway, scaled and repaired; Ray killed, links cut and the head powered off, and the console
noticing, looking twice and repairing by itself; a machine added; stop, start and delete; a cluster
whose machines are all offline deleted anyway.

The tests share one console (Daphne, worker, beat), one database and one cluster, "life" (lab-a the
head, lab-b), in the order they are written: each one does something else to the running cluster
and leaves it running (the `life` fixture starts it anew if a test did not). Each reads only what
happened since its own fault.
"""
import json
import time

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from clusters import leftovers, nccl_tests, services
from clusters.choices import CheckOutcome, ClusterState, MemberState, Role
from clusters.models import Cluster, HealthCheck, NcclTest, NcclTestState
from clusters.nccl_api import NcclTestSerializer
from console import roles
from console.choices import JOB_TERMINAL, JobState
from console.models import Job
from deployments import gateway_keys
from deployments import services as deployment_services
from deployments.choices import CopyState
from deployments.forms import ask_from
from deployments.models import Copy, Deployment
from machines.agent_client import Agent
from machines.choices import MachineState
from machines.models import Machine
from tests.harness import (FABRIC, INTERVALS, all_up, cluster_in, enrol, images_import, leave_nothing_running, ray_runs_on,
                           running, wait_for)
from tests.factories import UserFactory
from tests.integration import connect_lab, serve_lab
from tests.processes import console_processes

pytestmark = [pytest.mark.lab]

NAME = "life"
FABRIC_MBIT = 400  # lab/specs/default.toml: each machine's link on the fabric, shaped both ways
NCCL_SWEEP = {"FADEN_NCCL_TEST_MAX_BYTES": str(16 * 2**20), "FADEN_NCCL_TEST_ITERS": "2", "FADEN_NCCL_TEST_WARMUP": "1"}
SLOW_MBIT = 40  # the slow link's rate, as lab/specs/default.toml's slow network has it
# The worker's limit on a test, shortened from 10 minutes: at 40 Mbit/s the first 5 sizes (1 to 16 MiB, one
# iteration each) take about 50 s, the two after them about 150 s more.
NCCL_LIMIT = {"FADEN_NCCL_TEST_LIMIT_SECONDS": "120"}


@pytest.fixture(scope="module")
def console(lab, module_db):
    with console_processes(beat=True, env={**INTERVALS, **NCCL_LIMIT}, enqueue=True, gateway=True) as processes:
        yield processes


RUNTIME_MACHINES = ("lab-a", "lab-b", "lab-c")


@pytest.fixture(scope="module")
def machines(console, lab):
    """lab-a, lab-b and lab-c on Podman, as real machines, enrolled through the worker, and the lab's
    real image builds (Debian + Ray) imported; at the end nothing left running on them, and they are
    back on the fast `process` path for the modules after this one."""
    lab.runtime("podman", *RUNTIME_MACHINES)
    images_import(lab, None)
    enrolled = {m.name: m for m in enrol(lab, *RUNTIME_MACHINES)}
    assert {m.container_runtime for m in enrolled.values()} == {"podman"}
    yield enrolled
    lab.heal()
    leave_nothing_running(Machine.objects.all())
    lab.runtime("process", *RUNTIME_MACHINES)


def clusters_deleted() -> None:
    """No cluster left (a test that needs its machines free)."""
    def delete(pk: int) -> bool:
        cluster = Cluster.objects.filter(pk=pk).first()
        if cluster is None or cluster.state == ClusterState.DELETING:
            return True
        try:
            services.cluster_delete(cluster=cluster)
        except ValidationError:
            return False  # refused for now (a stop under way): asked again
        return True

    for pk in Cluster.objects.values_list("pk", flat=True):
        wait_for(lambda: delete(pk), timeout=60, what=f"cluster {pk} to accept Delete")
        wait_for(lambda: not Cluster.objects.filter(pk=pk).exists(), timeout=120, what=f"cluster {pk} to go")


@pytest.fixture
def life(lab, machines):
    """The shared cluster, running with every member Up; started anew when an earlier test left it otherwise."""
    lab.heal()

    def settled():
        cluster = Cluster.objects.filter(name=NAME).first()
        if cluster is None or cluster.state in (ClusterState.STOPPED, ClusterState.FAILED, ClusterState.WAITING):
            return "anew"
        return all_up(NAME)

    try:
        cluster = wait_for(settled, timeout=120, what=f"{NAME} to run with every machine Up")
    except TimeoutError:
        cluster = "anew"
    if cluster == "anew":
        clusters_deleted()
        running(NAME, [machines["lab-a"], machines["lab-b"]])
        cluster = wait_for(lambda: all_up(NAME), timeout=120, what=f"{NAME} with every machine Up")
    return cluster


def test_the_worker_killed_in_the_middle_of_a_start_is_replaced_and_the_start_still_reaches_running(lab, machines, console):
    clusters_deleted()
    a, b = machines["lab-a"], machines["lab-b"]
    services.cluster_create(name=NAME, machine_ids=[a.pk, b.pk], head_id=a.pk, network=FABRIC)
    job = wait_for(lambda: Job.objects.filter(kind="cluster.start", state="running", steps__1__state="running").first()
                   or Job.objects.filter(kind="cluster.start", state="running", steps__2__state="running").first(),
                   timeout=60, what="the start to reach its second step", every=0.1)

    console.kill_worker()
    console.start_worker()

    cluster = wait_for(lambda: all_up(NAME, 2), timeout=180, what="Running after the worker was replaced")
    job = wait_for(lambda: Job.objects.filter(pk=job.pk).exclude(state="running").first(), timeout=30, what="the job to end")
    assert job.state == "succeeded" and job.resumes == 1
    assert "Taken up again where it stopped" in job.log
    assert [s["state"] for s in job.steps] == ["done"] * len(job.steps)
    for address in ("198.18.0.11", "198.18.0.12"):  # Ray runs in the runtime container, as on a real machine
        assert lab.ssh(address, "podman ps --format '{{.Names}}'").stdout.split() == [f"fadenstack-{NAME}"]
    for member in cluster.members.all():  # the image crossed the network once, not once per run
        assert member.image_transfer.bytes_fetched <= member.runtime_image.size_bytes + member.runtime_image.chunk_size


def test_the_nccl_test_runs_in_the_runtime_containers_over_the_fabric_at_its_rate(lab, life, settings):
    """mpirun in lab-a's container, the other rank in lab-b's over the cluster's own SSH: every size, its
    peak near the fabric's rate, and nothing of the run left on either machine."""
    for name, value in NCCL_SWEEP.items():  # the test's row carries its sweep: the worker runs what it says
        setattr(settings, name, int(value))
    operator = UserFactory(username="nccl-ann", role=roles.OPERATOR)
    started = nccl_tests.nccl_test_start(cluster=life, user=operator)

    ended = wait_for(lambda: NcclTest.objects.filter(pk=started.pk).exclude(state=NcclTestState.RUNNING).first(),
                     timeout=120, what="the NCCL test to end")
    connect_lab.check_nccl_test_on_the_link(NcclTestSerializer(ended).data, rate_mbit=FABRIC_MBIT, max_bytes=16 * 2**20)
    for address in ("198.18.0.11", "198.18.0.12"):
        left = lab.ssh(address, "pgrep -af '[a]ll_reduce_perf|[o]rted|[m]pirun' || true").stdout  # [a]: not this line
        assert not left.strip(), f"{address}: {left}"


def test_the_nccl_test_on_a_40_mbit_link_stops_after_five_sizes_and_names_the_link(lab, life, settings):
    """lab-b's fabric link shaped to 40 Mbit/s: the sizes after the fifth would pass the (shortened) limit,
    so the test stops there and names the link. (The same cluster as the fabric run: a slow link is a rate,
    whichever network carries it.)"""
    settings.FADEN_NCCL_TEST_MAX_BYTES, settings.FADEN_NCCL_TEST_ITERS, settings.FADEN_NCCL_TEST_WARMUP = 64 * 2**20, 1, 0
    lab.fault("lab-b", "link-slow", "fabric", str(SLOW_MBIT))
    try:
        started = nccl_tests.nccl_test_start(cluster=life, user=UserFactory(username="nccl-slow", role=roles.OPERATOR))
        ended = wait_for(lambda: NcclTest.objects.filter(pk=started.pk).exclude(state=NcclTestState.RUNNING).first(),
                         timeout=150, what="the NCCL test to stop")
    finally:
        lab.fault("lab-b", "link-restore", "fabric")
    connect_lab.check_nccl_test_stops_on_a_slow_link(NcclTestSerializer(ended).data, ("lab-a", "lab-b"))


def test_a_model_deployed_in_the_runtime_containers_is_called_scaled_and_a_killed_copy_restarted(lab, life, machines, console):
    """The deployments' main path on the real runtime (the deployments module runs the `process` one): the
    lab's small model as 2 copies of 2 GPUs, each engine in the cluster's Podman container of its machine,
    called through the gateway (streamed and not, with a key); scaled to 3 with the first two untouched; a
    copy's engine killed in its container while the gateway keeps answering from the others, and the
    console restarting it; deleted, with nothing left running in the containers."""
    operator = UserFactory(username="ops-podman", role=roles.OPERATOR)
    both = [machines["lab-a"], machines["lab-b"]]
    ask = ask_from({"name": "tiny", "copies": 2, "kind": serve_lab.KIND, "gpu_quarters": 8, "memory_per_gpu_gib": 8,
                    "context_length": 2048}, cluster=life, model=serve_lab.tiny_model())
    deployment = deployment_services.deployment_create(ask=ask, user=operator)
    try:
        wait_for(serve_lab.serving(2), timeout=120, what="two copies serving in the runtime containers")
        first = dict(Copy.objects.filter(deployment=deployment).values_list("number", "pid"))
        assert len({c.machine_id for c in deployment.copy_rows.all()}) == 2  # spread
        for copy in deployment.copy_rows.select_related("machine"):  # the pid is the engine's in the container
            argv = lab.ssh(copy.machine.address, f"podman exec fadenstack-{NAME} cat /proc/{copy.pid}/cmdline").stdout
            words = argv.split("\0")  # the lab's engine is a Python script: python3 /usr/local/bin/vllm serve ...
            assert "serve" in words and words[words.index("serve") - 1].endswith("vllm"), argv
            assert words[words.index("--served-model-name") + 1] == "tiny", argv

        _, key = gateway_keys.gateway_key_create(name="lab", user=operator)
        wait_for(lambda: serve_lab.chat(console, key)[0] != 401, timeout=5, what="the gateway to know the new key", every=0.2)
        status, body = serve_lab.chat(console, key)
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["content"]
        status, streamed = serve_lab.chat(console, key, stream=True)
        assert status == 200 and streamed.rstrip().endswith(b"data: [DONE]") and streamed.count(b"data: {") >= 2
        assert serve_lab.chat(console, "fs-not-a-key")[0] == 401

        deployment_services.deployment_scale(deployment=deployment, copies=3, user=operator)
        wait_for(serve_lab.serving(3), timeout=120, what="a third copy serving")
        after = dict(Copy.objects.filter(deployment=deployment).values_list("number", "pid"))
        assert {n: after[n] for n in first} == first  # the first two were not restarted

        victim = Copy.objects.select_related("machine").get(deployment=deployment, number=1)
        caller = serve_lab.Caller(console, key)
        caller.start()
        time.sleep(0.5)  # some answers before the kill
        lab.ssh(victim.machine.address, f"podman exec fadenstack-{NAME} sh -c 'kill -9 {victim.pid}'")
        wait_for(lambda: Copy.objects.filter(pk=victim.pk, state=CopyState.SERVING, restarts=1).exists(), timeout=90,
                 what="the killed copy to be restarted")
        statuses = caller.stop()
        assert statuses and set(statuses) == {200}, statuses
        assert HealthCheck.objects.filter(cluster=life, outcome="repair", action__contains="Restarting tiny #1").exists()

        deployment_services.deployment_delete(deployment=deployment, user=operator)
        wait_for(lambda: not Deployment.objects.filter(pk=deployment.pk).exists(), timeout=60, what="tiny deleted")
        for machine in both:
            with Agent.open(machine) as agent:
                assert agent.copy_list() == [], machine.name
    finally:  # the tests after this one take every GPU (the NCCL test) or delete the cluster
        Deployment.objects.filter(pk=deployment.pk).delete()
        serve_lab.copies_cleared(both)


def test_ray_killed_on_a_worker_is_joined_again_while_the_head_keeps_running(lab, life, machines):
    since = timezone.now()
    lab.fault("lab-b", "ray-kill")

    down = wait_for(lambda: Cluster.objects.get(name=NAME).members.filter(machine__name="lab-b", state__in=[
        MemberState.DOWN, MemberState.REJOINING]).first(), timeout=30, what="the console to notice")
    assert "lab-b" in down.state_reason
    cluster = wait_for(lambda: all_up(NAME, 2), timeout=90, what="lab-b back in Ray")
    assert cluster.members.get(machine__name="lab-a").state == MemberState.JOINED
    outcomes = list(HealthCheck.objects.filter(cluster=cluster, started_at__gte=since).order_by("started_at")
                    .values_list("outcome", flat=True))
    assert CheckOutcome.LOOK_AGAIN in outcomes and CheckOutcome.REPAIR in outcomes
    assert outcomes.index(CheckOutcome.LOOK_AGAIN) < outcomes.index(CheckOutcome.REPAIR)  # it looked twice
    assert not Job.objects.filter(target_id=cluster.pk, kind="cluster.start", title__startswith="Restart",
                                  created_at__gte=since).exists()
    assert ray_runs_on(machines["lab-b"])


def test_ray_killed_on_the_head_restarts_the_cluster(lab, life):
    since = timezone.now()
    lab.fault("lab-a", "ray-kill")

    wait_for(lambda: "Restarting the cluster (attempt 1 of 3)" in (cluster_in(NAME, ClusterState.STARTING) or Cluster()).state_reason,
             timeout=40, what="the restart to begin")
    cluster = wait_for(lambda: all_up(NAME, 2), timeout=120, what="Running again after the restart")
    assert cluster.restart_attempt == 0
    assert HealthCheck.objects.filter(cluster=cluster, outcome=CheckOutcome.REPAIR, action__contains="attempt 1 of 3",
                                      started_at__gte=since).exists()


def test_a_worker_whose_fabric_link_went_down_is_repaired_once_it_is_back(lab, life):
    lab.fault("lab-b", "link-down", "fabric")
    try:
        wait_for(lambda: Cluster.objects.get(name=NAME).members.filter(machine__name="lab-b", state__in=[
            MemberState.DOWN, MemberState.FAILED]).exists(), timeout=120, what="lab-b out of the cluster")
        assert Cluster.objects.get(name=NAME).state == ClusterState.RUNNING  # the head keeps serving
    finally:
        lab.fault("lab-b", "link-up", "fabric")
    wait_for(lambda: all_up(NAME, 2), timeout=120, what="lab-b back after the link came up")


def test_the_head_powered_off_reads_failed_after_three_restarts_and_comes_back_after_power_on(lab, life):
    since = timezone.now()
    lab.fault("lab-a", "power-off")
    try:
        failed = wait_for(lambda: cluster_in(NAME, ClusterState.FAILED), timeout=180, what="Failed")
        assert "after 3 restarts" in failed.state_reason and "Try again" in failed.state_reason
        restarts = Job.objects.filter(target_id=failed.pk, kind="cluster.start", title__startswith="Restart",
                                      created_at__gte=since).count()
        assert restarts == 3
    finally:
        lab.fault("lab-a", "power-on")
    wait_for(lambda: all_up(NAME, 2), timeout=180, what="Running again after power-on")


def test_a_machine_added_to_a_running_cluster_gets_the_image_from_the_cluster_and_joins(life, machines):
    c = machines["lab-c"]
    before = sum(life.members.values_list("accelerators_in_ray", flat=True))

    services.cluster_add_machines(cluster=life, machine_ids=[c.pk])

    cluster = wait_for(lambda: all_up(NAME, 3), timeout=120, what="lab-c to join")
    added = cluster.members.get(machine=c)
    assert added.image_transfer.source.startswith(("lab-a", "lab-b"))  # from a machine of the cluster, not the server
    assert sum(cluster.members.values_list("accelerators_in_ray", flat=True)) == before + added.accelerators_in_ray > before


def test_stop_frees_the_machines_start_brings_it_back_and_delete_leaves_them_enrolled(lab, life, machines):
    members = list(life.members.select_related("machine"))

    services.cluster_stop(cluster=life)
    cluster = wait_for(lambda: cluster_in(NAME, ClusterState.STOPPED), timeout=60, what="Stopped")
    assert set(cluster.members.values_list("state", flat=True)) == {MemberState.STOPPED}
    assert not any(ray_runs_on(m.machine) for m in members)
    for m in members:  # the runtime container is gone, and with it the GPUs it held
        assert lab.ssh(m.machine.address, "podman ps -a --format '{{.Names}}'").stdout.split() == []
    assert cluster.network == FABRIC and cluster.members.count() == len(members)

    services.cluster_start(cluster=cluster)
    wait_for(lambda: all_up(NAME, len(members)), timeout=120, what="Running again with every machine")
    assert all(ray_runs_on(m.machine) for m in members)

    head = next(m.machine for m in members if m.role == Role.HEAD)
    lab.ssh(head.address, "echo weights > /shared/left-by-a-user.txt")
    job = services.cluster_delete(cluster=Cluster.objects.get(name=NAME))
    assert job is not None  # a running cluster is stopped first
    wait_for(lambda: not Cluster.objects.filter(name=NAME).exists(), timeout=60, what="the cluster to go")
    assert not any(ray_runs_on(m.machine) for m in members)
    assert Machine.objects.filter(pk__in=[m.machine.pk for m in members], membership__isnull=True,
                                  state=MachineState.HEALTHY).count() == len(members)
    check_freeing_what_the_cluster_left(lab, Machine.objects.get(pk=head.pk))


def check_freeing_what_the_cluster_left(lab, head: Machine) -> None:
    """What the Delete page says stays (the head's /shared, the runtime image in the store and in Podman) is
    there, and the machine page's jobs free it: the agent's shared clear and image remove on Podman."""
    assert "left-by-a-user.txt" in lab.ssh(head.address, "ls /shared").stdout
    assert "fadenstack-runtime" in lab.ssh(head.address, "podman images --format '{{.Repository}}'").stdout
    for start in (leftovers.machine_shared_free, leftovers.machine_images_free):
        job = start(machine=head)
        done = wait_for(lambda: Job.objects.filter(pk=job.pk, state__in=JOB_TERMINAL).first(), timeout=60, what=job.title)
        assert done.state == JobState.SUCCEEDED, (done.error, done.log)
    assert lab.ssh(head.address, "ls -A /shared").stdout.strip() == ""
    assert "fadenstack-runtime" not in lab.ssh(head.address, "podman images --format '{{.Repository}}'").stdout
    blobs = lab.ssh(head.address, "ls /var/lib/fadenstack/blobs 2>/dev/null || true").stdout.split()
    assert not [name for name in blobs if len(name) == 64], blobs


def test_a_cluster_whose_machines_are_all_offline_is_deleted_anyway_and_its_leftovers_are_replaced(lab, machines):
    clusters_deleted()
    c = machines["lab-c"]
    cluster = running("gone", [c])

    lab.fault("lab-c", "power-off")
    try:
        wait_for(lambda: Machine.objects.filter(pk=c.pk, state=MachineState.OFFLINE).exists(), timeout=40, what="lab-c offline")
        assert services.cluster_delete(cluster=Cluster.objects.get(pk=cluster.pk)) is None
        assert not Cluster.objects.filter(pk=cluster.pk).exists()
    finally:
        lab.fault("lab-c", "power-on")
    wait_for(lambda: Machine.objects.filter(pk=c.pk, state=MachineState.HEALTHY).exists(), timeout=40, what="lab-c back")
    running("again", [c])
