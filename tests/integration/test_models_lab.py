"""Models on the lab: the server downloads from the lab hub (a gated model only with the token), the
files travel to a cluster's machines (one copy from the server, then machine to machine, a cut link
resumed), and a cluster whose machines download models themselves (every machine's reach checked
first; the token on no command line)."""
import os
import threading
import time
from pathlib import Path

import pytest

from clusters.choices import ClusterState, ModelSource
from clusters.models import Cluster, Transfer
from console.models import Job
from deployments.choices import ModelState
from deployments.models import ModelHolding
from deployments.store import services, sources
from deployments.store.hub_token import hf_token_set
from lab import hub_models
from lab.hub import HubServer
from machines.agent_client import Agent
from machines.models import Machine
from tests.builders import cluster_of
from tests.harness import enrol, leave_nothing_running, wait_for

pytestmark = [pytest.mark.lab, pytest.mark.django_db(transaction=True)]

MEDIUM = "fadenstack-lab/medium-chat"
TINY = "fadenstack-lab/tiny-chat"
GATED = "fadenstack-lab/gated-chat"


@pytest.fixture
def hub(lab, settings, console_url):
    """The lab hub as the server's hub; the machines' stores emptied of models afterwards."""
    status = lab.status()["hub"]
    settings.FADEN_HF_ENDPOINT = status["url"]
    names = []

    def enrol_these(*wanted):
        names.extend(wanted)
        return enrol(lab, *wanted)

    yield status, enrol_these
    lab.heal()
    for machine in Machine.objects.filter(name__in=names):
        with Agent.open(machine) as agent:
            for placed in agent.model_list().models:
                agent.model_remove(repo=placed.repo, revision=placed.revision)
    leave_nothing_running(Machine.objects.filter(name__in=names))


def copy_in_background(model, cluster) -> threading.Event:
    done = threading.Event()

    def copy():
        try:
            services.model_copy(model, cluster)
        finally:
            done.set()

    threading.Thread(target=copy).start()
    return done


@pytest.fixture
def loopback_hub(settings):
    """A lab hub on loopback, for a download whose rate the test does not look at (the lab hub's link
    is 400 Mbit/s: bench/models.py measures that one)."""
    server = HubServer("127.0.0.1", 0, cache_dir=hub_models.default_cache_dir())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    settings.FADEN_HF_ENDPOINT = server.url
    yield server
    server.shutdown()
    server.server_close()


def test_the_medium_model_reaches_three_machines_with_one_copy_from_the_server_and_a_cut_link_resumes(lab, hub, loopback_hub):
    _, enrol_these = hub
    a, b, c = enrol_these("lab-a", "lab-b", "lab-c")
    model = services.model_add(repo=MEDIUM)  # eager: downloaded when this returns
    model.refresh_from_db()
    assert model.state == ModelState.READY, model.state_reason
    assert model.facts["architecture"] == "LlamaForCausalLM" and model.facts["weight_bytes"] > 500 * 2**20
    weights = model.files.get(path="model.safetensors")

    cluster = cluster_of([a, b, c], state=ClusterState.STOPPED, name="models")
    lab.fault("lab-a", "link-slow", "mgmt", "1000")  # the first copy at the fabric's pace, not the management's
    done = copy_in_background(model, cluster)
    wait_for(lambda: (t := Transfer.objects.filter(member__machine=c, digest=weights.sha256).first())
             and t.bytes_done > 0.3 * t.bytes_total, timeout=180, what="lab-c to hold a third of the weights", every=0.05)
    lab.fault("lab-c", "link-down", "fabric")
    time.sleep(3)  # a cut, not a blip: the transfer notices and tries again
    lab.fault("lab-c", "link-up", "fabric")
    assert done.wait(300)

    job = Job.objects.filter(kind="model.copy", target_id=cluster.pk).get()
    assert job.state == "succeeded", job.error
    transfers = {t.member.machine.name: t for t in Transfer.objects.filter(digest=weights.sha256).select_related("member__machine")}
    assert transfers["lab-a"].source == "the server"  # the server sent one copy; the machines passed it on
    assert transfers["lab-b"].source.startswith("lab-a (198.18.1.11)")
    assert transfers["lab-c"].source.startswith("lab-b (198.18.1.12)")
    assert weights.size <= transfers["lab-c"].bytes_fetched <= weights.size + weights.chunk_size  # at most one chunk again
    assert Transfer.objects.filter(source="the server").count() == model.files.count()
    assert set(ModelHolding.objects.filter(model=model).values_list("machine__name", flat=True)) == {"lab-a", "lab-b", "lab-c"}
    with Agent.open(c) as agent:
        placed = {(m.repo, m.revision): m for m in agent.model_list().models}
    assert placed[(MEDIUM, model.commit)].bytes == model.bytes_total


def test_machine_downloads_need_every_machine_to_reach_the_hub_and_the_token_shows_nowhere(lab, hub):
    status, enrol_these = hub
    a, b = enrol_these("lab-a", "lab-b")
    cluster = cluster_of([a, b], state=ClusterState.STOPPED, name="downloads")

    lab.fault("lab-b", "hub-cut")
    job = sources.model_source_set(cluster, ModelSource.MACHINES)
    job.refresh_from_db()
    assert job.state == "failed"
    assert "lab-b" in job.error and "no route to host" in job.error and "lab-a" not in job.error
    assert "downloads keeps Server copies" in job.error
    assert Cluster.objects.get(pk=cluster.pk).model_source == ModelSource.SERVER
    lab.fault("lab-b", "hub-restore")
    job = sources.model_source_set(cluster, ModelSource.MACHINES)
    job.refresh_from_db()
    assert job.state == "succeeded", job.error
    cluster.refresh_from_db()
    assert cluster.model_source == ModelSource.MACHINES

    small = services.model_add(repo=TINY)  # the server's own download from the lab hub, over its link
    small.refresh_from_db()
    assert small.state == ModelState.READY and small.bytes_done == small.bytes_total > 60 * 2**20, small.state_reason
    gated = services.model_add(repo=GATED)  # no token yet: refused in words, nothing kept
    gated.refresh_from_db()
    assert gated.state == ModelState.FAILED and "is a gated model: the hub asks for a token" in gated.state_reason
    services.model_delete(gated)

    token = Path(status["token_file"]).read_text().strip()
    hf_token_set(token=token, by=None)
    seen: list[str] = []
    stop = threading.Event()
    watcher = threading.Thread(target=watch_command_lines, args=(token, seen, stop))
    watcher.start()
    try:
        model = services.model_add(repo=GATED)  # the server's own download, with the token
        model.refresh_from_db()
        assert model.state == ModelState.READY, model.state_reason
        services.model_copy(model, cluster)  # each machine downloads it from the hub, the token on stdin
    finally:
        stop.set()
        watcher.join()
    copy = Job.objects.filter(kind="model.copy", target_id=cluster.pk).get()
    assert copy.state == "succeeded", copy.error
    assert seen == [], f"the token was on these command lines: {seen}"
    assert {t.source for t in Transfer.objects.filter(member__cluster=cluster)} == {f"the hub ({status['url']})"}
    assert set(ModelHolding.objects.filter(model=model).values_list("machine__name", flat=True)) == {"lab-a", "lab-b"}
    for job in Job.objects.all():
        assert token not in job.log + job.error + str(job.params) + str(job.steps)
    logs = [p for p in Path(lab.state_dir).rglob("*") if p.is_file() and p.suffix in (".log", ".json", ".txt")]
    logs += [p for p in Path("/var/lib/fadenstack").glob("*.log")]
    assert logs and not [str(p) for p in logs if token.encode() in p.read_bytes()]


def watch_command_lines(token: str, seen: list[str], stop: threading.Event) -> None:
    """Every process's command line on the host (the lab's machines are processes of this host too), read
    every few milliseconds until stopped; any holding the token is kept."""
    wanted = token.encode()
    while not stop.is_set():
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        line = f.read()
                except OSError:
                    continue
                if wanted in line:
                    seen.append(line.replace(b"\0", b" ").decode(errors="replace"))
        time.sleep(0.005)
