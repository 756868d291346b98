"""Deployments on the lab, with a real worker, beat and gateway, on one three-machine cluster ("serve"): the
small lab model deployed as 2 copies of 2 GPUs and called through the gateway; the cluster stopped and
started and the deployment serving again; the console's processes restarted while the copies keep
answering; a copy over two machines; and a queued copy that starts by itself once another deployment's
delete frees the room. Then a person's own job on a GPU of lab-a: its heartbeat brings it to the machine's
page, and placement leaves its GPUs alone.

The machines run the lab's `process` runtime: the engines are real processes reading the model's files
from each machine's store. The main path on the real runtime (deploy, the gateway, scale, a killed copy
restarted) runs in Podman's containers in the cluster life module (test_cluster_life_lab.py), on the
cluster it has running already; the agent's copies in Podman alone in tests/lab/test_copies_lab.py."""
import re
import time

import pytest
from django.test import Client

from clusters.choices import ClusterState
from clusters.models import Cluster
from clusters.services import cluster_start, cluster_stop
from console import roles
from console.models import Job
import deployments.serving
from deployments import gateway_keys, services
from deployments.choices import CopyState
from deployments.forms import ask_from
from deployments.models import Copy, Deployment
from machines.agent_client import Agent
from machines.models import Accelerator, Machine
from tests.factories import UserFactory
from tests.harness import INTERVALS, all_up, enrol, images_import, leave_nothing_running, running, wait_for
from tests.integration.serve_lab import KIND, Caller, call, chat, copies_cleared, serving, tiny_model
from tests.processes import console_processes

pytestmark = [pytest.mark.lab]

MACHINES = ("lab-a", "lab-b", "lab-c")


@pytest.fixture(scope="module")
def console(lab, module_db):
    with console_processes(beat=True, env=INTERVALS, enqueue=True, gateway=True) as processes:
        yield processes


@pytest.fixture(scope="module")
def machines(console, lab):
    images_import(lab)
    enrolled = {m.name: m for m in enrol(lab, *MACHINES)}
    yield enrolled
    for deployment in Deployment.objects.all():
        Copy.objects.filter(deployment=deployment).delete()
        deployment.delete()
    lab.heal()
    copies_cleared(Machine.objects.filter(name__in=MACHINES))
    leave_nothing_running(Machine.objects.filter(name__in=MACHINES))


@pytest.fixture(scope="module")
def cluster(machines):
    """The module's one cluster, started once: each test leaves it running."""
    return running("serve", [machines[name] for name in MACHINES])


@pytest.fixture(scope="module")
def model(machines):
    return tiny_model()


def test_a_model_deployed_called_stopped_started_and_served_through_restarts(lab, console, cluster, model):
    operator = UserFactory(username="ops-lab", role=roles.OPERATOR)
    ask = ask_from({"name": "tiny", "copies": 2, "kind": KIND, "gpu_quarters": 8,
                    "memory_per_gpu_gib": 8, "context_length": 2048}, cluster=cluster, model=model)
    deployment = services.deployment_create(ask=ask, user=operator)
    wait_for(serving(2), timeout=120, what="two copies serving")
    assert len({c.machine_id for c in deployment.copy_rows.all()}) == 2  # spread

    _, key = gateway_keys.gateway_key_create(name="lab", user=operator)
    wait_for(lambda: chat(console, key)[0] != 401, timeout=5, what="the gateway to know the new key", every=0.2)
    status, body = chat(console, key)
    assert status == 200, body
    assert chat(console, "fs-not-a-key")[0] == 401

    # Stop keeps the deployment; Start applies it again.
    cluster_stop(cluster=Cluster.objects.get(pk=cluster.pk))
    wait_for(lambda: Cluster.objects.filter(pk=cluster.pk, state=ClusterState.STOPPED).exists(), timeout=60, what="Stopped")
    assert set(deployment.copy_rows.values_list("state", flat=True)) == {CopyState.STOPPED}
    assert chat(console, key)[0] == 503
    cluster_start(cluster=Cluster.objects.get(pk=cluster.pk))
    wait_for(lambda: all_up("serve", 3), timeout=120, what="Running again")
    wait_for(serving(2), timeout=120, what="the copies serving again after Start")
    # The gateway picks up copies within a second of their Serving.
    wait_for(lambda: chat(console, key)[0] == 200, timeout=3, every=0.2, what="the gateway to route to them again")

    # The console's processes restart; the copies (and the gateway) keep answering throughout.
    pids = dict(Copy.objects.filter(deployment=deployment).values_list("number", "pid"))
    caller = Caller(console, key)
    caller.start()
    console.restart("web", "worker", "beat")
    time.sleep(2)
    statuses = caller.stop()
    assert statuses and set(statuses) == {200}, statuses
    assert dict(Copy.objects.filter(deployment=deployment).values_list("number", "pid")) == pids

    # A copy larger than any machine (16 GPUs; the machines have 8) spans two machines through a Ray of its
    # own: each pipeline stage on the GPUs the plan gave it there; served through the gateway; deleted, it
    # leaves nothing running on either machine.
    services.deployment_scale(deployment=deployment, copies=0, user=operator)
    wait_for(lambda: not Copy.objects.filter(deployment=deployment).exists(), timeout=60, what="tiny scaled to 0")
    wide = services.deployment_create(ask=ask_from(
        {"name": "tiny-wide", "copies": 1, "kind": "nvidia|H100 80GB|81559|x86_64", "gpu_quarters": 64,
         "memory_per_gpu_gib": 8, "context_length": 2048}, cluster=cluster, model=model), user=operator)
    wait_for(lambda: Copy.objects.filter(deployment=wide, state__in=[CopyState.SERVING, CopyState.FAILED]).exists(),
             timeout=120, what="the copy over two machines serving")
    copy = Copy.objects.get(deployment=wide)
    assert copy.state == CopyState.SERVING, (copy.state_reason, copy.log_tail)
    members = {m.machine_id: m for m in cluster.members.select_related("machine")}
    first, second = (members[slot["machine"]] for slot in copy.slots)
    with Agent.open(first.machine) as agent:
        log = "\n".join(agent.copy_logs(copy.key, lines=200))
    for member in (first, second):  # a stage on each machine, on the 8 GPUs the plan gave it there
        assert re.search(rf"pipeline stage [01] on {re.escape(member.address)}: GPUs 0,1,2,3,4,5,6,7$", log, re.M), log
    def wide_call():
        return call(f"{console.gateway_url}/v1/chat/completions", key,
                    {"model": "tiny-wide", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 4})

    # As above: the gateway routes to a copy within a second or so of its Serving, not at the same instant.
    wait_for(lambda: wide_call()[0] != 503, timeout=3, every=0.2, what="the gateway to route to tiny-wide")
    status, body = wide_call()
    assert status == 200, body
    services.deployment_delete(deployment=wide, user=operator)
    wait_for(lambda: not Deployment.objects.filter(pk=wide.pk).exists(), timeout=60, what="tiny-wide deleted")
    for member in (first, second):
        with Agent.open(member.machine) as agent:
            assert [s.copy for s in agent.copy_list()] == []


def test_a_queued_copy_starts_by_itself_once_another_deployment_is_deleted(cluster, model):
    """The H100s of lab-a and lab-b are taken by "tiny-big" (2 copies of 8 GPUs): "tiny-wait" is queued for
    room. Deleting tiny-big frees them, and tiny-wait's copy starts with nothing asked of tiny-wait."""
    operator = UserFactory(username="ops-room", role=roles.OPERATOR)

    def whole_machines(name: str, copies: int, **options):
        return services.deployment_create(ask=ask_from(
            {"name": name, "copies": copies, "kind": KIND, "gpu_quarters": 32, "memory_per_gpu_gib": 8,
             "context_length": 2048}, cluster=cluster, model=model), user=operator, **options)

    big = whole_machines("tiny-big", 2)
    wait_for(serving(2, "tiny-big"), timeout=120, what="tiny-big serving on every H100")
    waiting = whole_machines("tiny-wait", 1, queue_rest=True)
    queued = waiting.copy_rows.get()
    assert queued.state == CopyState.QUEUED and queued.state_reason.startswith("Waiting for room: "), queued.state_reason
    wait_for(lambda: not Job.objects.filter(target_type="deployment", target_id=waiting.pk, state__in=["queued", "running"])
             .exists(), timeout=30, what="tiny-wait's own apply to end with its copy queued")
    asked = set(Job.objects.filter(target_type="deployment", target_id=waiting.pk).values_list("pk", flat=True))

    services.deployment_delete(deployment=big, user=operator)

    wait_for(serving(1, "tiny-wait"), timeout=120, what="tiny-wait's queued copy serving once tiny-big went")
    assert not Deployment.objects.filter(pk=big.pk).exists()
    woken = Job.objects.filter(target_type="deployment", target_id=waiting.pk).exclude(pk__in=asked)
    assert [(job.kind, job.created_by_id) for job in woken] == [(deployments.serving.KIND, None)]  # nobody asked
    services.deployment_delete(deployment=waiting, user=operator)
    wait_for(lambda: not Deployment.objects.filter(pk=waiting.pk).exists(), timeout=60, what="tiny-wait deleted")


def test_a_gpu_a_persons_own_job_uses_shows_on_its_machine_and_no_copy_is_placed_on_it(lab, console, cluster, machines):
    """On the module's cluster, with tiny scaled to 0 by the first test: a process of lab-a that the console did
    not start declares every GPU of the machine to the lab's nvidia-smi (2 GiB on each). lab-a's heartbeat
    reads it within 10 s; its page names it; tiny scaled to 3 copies, which spread would have put on both
    machines with H100s, goes to lab-b alone. Once the process ends, the next read clears it."""
    operator = UserFactory(username="ops-gpus", role=roles.OPERATOR)
    deployment = Deployment.objects.get(name="tiny")
    a = machines["lab-a"]
    started = lab.ssh(a.address, "FADEN_LAB_GPU_MEMORY_MIB=2048 setsid sleep 600 >/dev/null 2>&1 </dev/null & echo $!")
    assert started.returncode == 0, started.stderr
    pid = int(started.stdout.split()[-1])
    try:
        wait_for(lambda: set(map(tuple, Accelerator.objects.filter(machine=a).values_list("foreign_pids", flat=True)))
                 == {(pid,)}, timeout=20, what="lab-a's heartbeat to report the job on every GPU")
        viewer = Client()
        viewer.force_login(UserFactory(username="viewer-lab", role=roles.VIEWER))
        page = viewer.get(f"/machines/{a.pk}/").content.decode()
        assert f"GPU 3: used by a process the console did not start, pid {pid} (2048 MiB)" in page

        services.deployment_scale(deployment=deployment, copies=3, user=operator)
        wait_for(serving(3), timeout=120, what="three copies serving beside the job")
        # lab-a and lab-b have the H100s (lab-c's are A100s): spread would have put one copy on lab-a at least.
        assert {slot["machine"] for copy in Copy.objects.filter(deployment=deployment) for slot in copy.slots} == {
            machines["lab-b"].pk}
    finally:
        lab.ssh(a.address, f"kill {pid}")
    wait_for(lambda: not Accelerator.objects.filter(machine=a).exclude(foreign_pids=[]).exists(), timeout=20,
             what="lab-a's GPUs free again once the job ended")
    services.deployment_scale(deployment=deployment, copies=0, user=operator)
    wait_for(lambda: not Copy.objects.filter(deployment=deployment).exists(), timeout=60, what="tiny scaled to 0")
