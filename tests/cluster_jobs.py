"""What the unit tests of a cluster's job steps share (the node settings', /shared's): a Ray node as the
fake agent lists it, pushes and health checks kept quiet, keys in the test's own directory, and a
runtime image whose file the server holds, three machines' agents with gpu-a leading Ray, and a job run
through its task. A test module imports these names to use them."""
import pytest

from clusters import tasks
from console import live
from console.models import Job
from tests.builders import build
from tests.fakes import FakeAgents


def step_of(job, step) -> dict:
    """The job's step as its card reads it: name, state and detail (how long it ran is the job's own test's)."""
    found = next(s for s in job.steps if s["name"] == step.name)
    return {key: found[key] for key in ("name", "state", "detail")}


def node(host: int) -> dict:
    return {"address": f"198.18.1.{host}", "alive": True, "gpus": 8, "node_id": f"node-{host}"}


@pytest.fixture(autouse=True)
def quiet(settings, tmp_path, monkeypatch):
    monkeypatch.setattr(live, "push", lambda *args, **kwargs: None)
    monkeypatch.setattr(tasks.cluster_check, "apply_async", lambda *args, **kwargs: None)
    settings.FADEN_SECRETS_KEY_PATH = tmp_path / "keys" / "secrets.key"
    settings.FADEN_SSH_CA_KEY_PATH = tmp_path / "ssh" / "ca_ed25519"
    settings.FADEN_TLS_DIR = tmp_path / "tls"  # the TLS authority's keys are sealed with that secrets key


@pytest.fixture
def image(tmp_path):
    image = build("2.1.0")
    held = tmp_path / "runtime.img"
    held.write_bytes(b"x" * image.size_bytes)
    image.path, image.chunk_hashes = str(held), ["c" * 64]
    image.save()
    return image


@pytest.fixture
def agents(monkeypatch):
    """The fake agents of gpu-a, gpu-b and gpu-c (198.18.1.11 to .13), gpu-a's Ray listing all three."""
    fakes = FakeAgents({"gpu-a": {"ray": {"alive_nodes": 3, "gpus": 24, "nodes": [node(11), node(12), node(13)]}}})
    return fakes.install(monkeypatch)


def run(job: Job) -> Job:
    """The job through its task (tasks are eager: a job made in a transaction ran on commit already, and a job
    that ended runs no second time), read back."""
    tasks.cluster_job(job.pk)
    return Job.objects.get(pk=job.pk)
