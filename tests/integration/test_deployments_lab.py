"""Deployments on the lab, with a real worker, beat and gateway: the small lab model deployed as 2 copies of
2 GPUs on a three-machine cluster and called through the gateway (streamed and not, with a key); scaled
to 3 with the first two untouched; a copy's engine killed while the gateway keeps answering from the
other copies and the console restarts it; the cluster stopped and started and the deployment serving
again; the console's processes restarted while the copies keep answering. Then a person's own job on a GPU of
lab-a: its heartbeat brings it to the machine's page, and placement leaves its GPUs alone.

One test, because each part needs what the part before it left (a cluster started and a model placed
cost the suite some 20 s). The machines run the lab's `process` runtime: the engines are real processes
reading the model's files from each machine's store; the same copies in Podman's container are
tested by tests/lab/test_copies_lab.py."""
import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from clusters.choices import ClusterState
from clusters.models import Cluster, HealthCheck
from clusters.services import cluster_start, cluster_stop
from console import roles
from deployments import gateway_keys, services
from deployments.choices import CopyState
from deployments.forms import ask_from
from deployments.models import Copy, Deployment
from deployments.store import downloads
from lab import hub_models
from machines.agent_client import Agent
from machines.models import Accelerator, Machine
from tests.factories import UserFactory
from tests.harness import INTERVALS, all_up, enrol, images_import, leave_nothing_running, running, wait_for
from tests.processes import console_processes

pytestmark = [pytest.mark.lab]

TINY = "fadenstack-lab/tiny-chat"
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
    for machine in Machine.objects.filter(name__in=MACHINES):
        try:
            with Agent.open(machine) as agent:
                for status in agent.copy_list():
                    agent.copy_stop(status.copy)
                for placed in agent.model_list().models:
                    agent.model_remove(repo=placed.repo, revision=placed.revision)
        except Exception:  # noqa: BLE001 (a machine a failed test left off: heal() brought it back or will)
            pass
    leave_nothing_running(Machine.objects.filter(name__in=MACHINES))


def tiny_model():
    store = hub_models.ModelStore(hub_models.default_cache_dir())
    plan = hub_models.MODELS[TINY]
    store.files(plan)  # generated once per host, then cached
    return downloads.model_import(directory=store.model_dir(plan) / "files", repo=TINY)


def call(url: str, key: str, body: dict, timeout: float = 30) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def chat(console, key: str, *, stream: bool = False) -> tuple[int, bytes]:
    return call(f"{console.gateway_url}/v1/chat/completions", key,
                {"model": "tiny", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8, "stream": stream})


def serving(count: int):
    return lambda: (Deployment.objects.filter(name="tiny").first() is not None and
                    Copy.objects.filter(deployment__name="tiny", state=CopyState.SERVING).count() == count
                    and Copy.objects.filter(deployment__name="tiny").count() == count)


class Caller(threading.Thread):
    """Calls the gateway over and over until stopped; every answer's status is kept."""

    def __init__(self, console, key: str):
        super().__init__(daemon=True)
        self.console, self.key, self.statuses, self.halt = console, key, [], threading.Event()

    def run(self):
        while not self.halt.is_set():
            self.statuses.append(chat(self.console, self.key)[0])
            time.sleep(0.05)

    def stop(self) -> list[int]:
        self.halt.set()
        self.join(timeout=60)
        return self.statuses


def test_a_model_deployed_called_scaled_repaired_stopped_started_and_served_through_restarts(lab, console, machines):
    operator = UserFactory(username="ops-lab", role=roles.OPERATOR)
    model = tiny_model()
    cluster = running("serve", [machines[name] for name in MACHINES])
    ask = ask_from({"name": "tiny", "copies": 2, "kind": "nvidia|H100 80GB|81559|x86_64", "gpu_quarters": 8,
                    "memory_per_gpu_gib": 8, "context_length": 2048}, cluster=cluster, model=model)
    deployment = services.deployment_create(ask=ask, user=operator)
    wait_for(serving(2), timeout=120, what="two copies serving")
    first = dict(Copy.objects.filter(deployment=deployment).values_list("number", "pid"))
    assert len({c.machine_id for c in deployment.copy_rows.all()}) == 2  # spread

    _, key = gateway_keys.gateway_key_create(name="lab", user=operator)
    wait_for(lambda: chat(console, key)[0] != 401, timeout=5, what="the gateway to know the new key", every=0.2)
    status, body = chat(console, key)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["model"] == "tiny" and answer["choices"][0]["message"]["content"]
    status, streamed = chat(console, key, stream=True)
    assert status == 200 and streamed.rstrip().endswith(b"data: [DONE]") and streamed.count(b"data: {") >= 2
    assert chat(console, "fs-not-a-key")[0] == 401

    services.deployment_scale(deployment=deployment, copies=3, user=operator)
    wait_for(serving(3), timeout=120, what="a third copy serving")
    after = dict(Copy.objects.filter(deployment=deployment).values_list("number", "pid"))
    assert {n: after[n] for n in first} == first  # the first two were not restarted

    # A copy's engine killed: the gateway keeps answering from the others, the console restarts it.
    victim = Copy.objects.select_related("machine").get(deployment=deployment, number=1)
    caller = Caller(console, key)
    caller.start()
    time.sleep(0.5)
    lab.ssh(victim.machine.address, f"kill -9 {victim.pid}")
    wait_for(lambda: Copy.objects.filter(pk=victim.pk, state=CopyState.SERVING, restarts=1).exists(), timeout=90,
             what="the killed copy to be restarted")
    statuses = caller.stop()
    assert statuses and set(statuses) == {200}, statuses
    assert HealthCheck.objects.filter(cluster=cluster, outcome="repair", action__contains="Restarting tiny #1").exists()

    # Stop keeps the deployment; Start applies it again.
    cluster_stop(cluster=Cluster.objects.get(pk=cluster.pk))
    wait_for(lambda: Cluster.objects.filter(pk=cluster.pk, state=ClusterState.STOPPED).exists(), timeout=60, what="Stopped")
    assert set(deployment.copy_rows.values_list("state", flat=True)) == {CopyState.STOPPED}
    assert chat(console, key)[0] == 503
    cluster_start(cluster=Cluster.objects.get(pk=cluster.pk))
    wait_for(lambda: all_up("serve", 3), timeout=120, what="Running again")
    wait_for(serving(3), timeout=120, what="the copies serving again after Start")
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


def test_a_gpu_a_persons_own_job_uses_shows_on_its_machine_and_no_copy_is_placed_on_it(lab, console, machines):
    """On the cluster the test above left running (tiny scaled to 0): a process of lab-a that the console did
    not start declares every GPU of the machine to the lab's nvidia-smi (2 GiB on each). lab-a's heartbeat
    reads it within 10 s; its page names it; tiny scaled to 3 copies, which spread would have put on both
    machines with H100s, goes to lab-b alone. Once the process ends, the next read clears it."""
    operator = get_user_model().objects.get(username="ops-lab")  # the test above made them
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
