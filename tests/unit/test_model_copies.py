"""Copying a model to a cluster's machines, with fake agents: the chain's plan, room made, refusals,
machine downloads with the token, and the first copy's download from the server."""
import pytest
from django.core.exceptions import ValidationError

from clusters.choices import ClusterState, MemberState, ModelSource
from clusters.models import Transfer
from console import roles
from console.choices import ErrorKind
from console.models import Job
from deployments.choices import ModelState
from deployments.models import ModelFile, ModelHolding, StoredModel
from deployments.store import disk, machine_files, services
from machines.agent_client import AgentError
from machines.agent_results import PlacedModel
from tests.builders import cluster_of, gpu_machine
from tests.factories import UserFactory
from tests.fakes import FakeAgent, FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # the bars are written from the board's own thread

MiB = 1 << 20


@pytest.fixture
def model():
    model = StoredModel.objects.create(repo="org/chat", commit="c" * 40, state=ModelState.READY, bytes_total=40 * MiB)
    ModelFile.objects.create(model=model, path="config.json", size=1000, sha256="1" * 64, chunk_size=disk.CHUNK_SIZE,
                             chunk_hashes=["a" * 64])
    ModelFile.objects.create(model=model, path="model.safetensors", size=40 * MiB - 1000, sha256="2" * 64,
                             chunk_size=disk.CHUNK_SIZE, chunk_hashes=["b" * 64] * 5)
    return model


@pytest.fixture
def cluster():
    return cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12), gpu_machine("lab-c", 13)],
                      state=ClusterState.STOPPED)


def copy(model, cluster) -> Job:
    services.model_copy(model, cluster, user=UserFactory(role=roles.OPERATOR))
    return Job.objects.get(kind=machine_files.KIND)


def test_server_copies_send_one_copy_from_the_server_then_machine_to_machine(model, cluster, monkeypatch):
    fakes = FakeAgents().install(monkeypatch)
    job = copy(model, cluster)
    assert job.state == "succeeded", job.error

    fetches = [(name, kw["url"]) for name, method, kw in fakes.calls if method == "file_fetch"]
    weights = sorted((name, url) for name, url in fetches if "2222" in url)
    assert weights == [("lab-a", f"https://198.18.0.1:8443/agent/models/{'2' * 64}/"),
                       ("lab-b", f"http://198.18.1.11:7470/blobs/{'2' * 64}"),
                       ("lab-c", f"http://198.18.1.12:7470/blobs/{'2' * 64}")]
    assert {(name, method) for name, method, _ in fakes.calls if method == "serve_stop"} == {
        ("lab-a", "serve_stop"), ("lab-b", "serve_stop"), ("lab-c", "serve_stop")}  # a stopped cluster serves nothing after
    assert set(ModelHolding.objects.values_list("machine__name", flat=True)) == {"lab-a", "lab-b", "lab-c"}
    assert {t.what for t in Transfer.objects.all()} == {"org/chat"}  # one bar per machine per model


def test_a_store_short_of_room_loses_the_models_no_copy_needs_first(model, cluster, monkeypatch):
    fakes = FakeAgents({"lab-c": {"free_bytes": 10 * MiB}}).install(monkeypatch)
    old = StoredModel.objects.create(repo="org/old", commit="d" * 40, state=ModelState.READY)
    fakes.models["lab-c"] = {("org/old", "d" * 40): PlacedModel(repo="org/old", revision="d" * 40, path="/x", bytes=50 * MiB, files=3)}
    ModelHolding.objects.create(model=old, machine=cluster.members.get(machine__name="lab-c").machine)

    job = copy(model, cluster)
    assert job.state == "succeeded", job.error
    assert ("lab-c", "model_remove", {"repo": "org/old", "revision": "d" * 40}) in fakes.calls
    assert "lab-c: removed org/old to make room" in job.steps[0]["detail"]
    assert not ModelHolding.objects.filter(model=old).exists()


def test_no_room_and_nothing_to_remove_fails_in_words(model, cluster, monkeypatch):
    FakeAgents({"lab-b": {"free_bytes": 5 * MiB}}).install(monkeypatch)
    job = copy(model, cluster)
    assert job.state == "failed" and job.error_kind == "no_room"
    assert job.error.startswith("lab-b has 5.2 MB free in its store; org/chat needs 41.9 MB.")


def test_machine_downloads_hand_the_token_to_each_agent_and_never_to_the_job(model, cluster, monkeypatch, settings):
    fakes = FakeAgents().install(monkeypatch)
    settings.FADEN_HF_ENDPOINT = "http://198.18.0.250:8090"
    monkeypatch.setattr(machine_files, "hf_token", lambda: "hf_secret_token_value")
    cluster.model_source = ModelSource.MACHINES
    cluster.save()
    job = copy(model, cluster)
    assert job.state == "succeeded", job.error
    downloads = [kw for _, method, kw in fakes.calls if method == "model_download"]
    assert len(downloads) == 3 and {kw["token"] for kw in downloads} == {"hf_secret_token_value"}
    assert not any(method == "file_fetch" for _, method, _ in fakes.calls)
    assert "hf_secret_token_value" not in str(job.params) + job.log + str(job.steps)
    assert {t.source for t in Transfer.objects.all()} == {"the hub (http://198.18.0.250:8090)"}


def test_copies_are_refused_for_a_model_not_ready_a_busy_cluster_and_old_agents(model, cluster):
    operator = UserFactory(role=roles.OPERATOR)
    downloading = StoredModel.objects.create(repo="org/next", state=ModelState.DOWNLOADING)
    with pytest.raises(ValidationError, match="org/next is downloading"):
        services.model_copy(downloading, cluster, user=operator)
    lab_b = cluster.members.get(machine__name="lab-b").machine
    lab_b.agent_version = "0.3.0"
    lab_b.save()
    with pytest.raises(ValidationError, match=r"lab-b \(0.3.0\) runs an older one: select Update agent"):
        services.model_copy(model, cluster, user=operator)
    assert not Job.objects.exists()


def test_the_first_copy_is_served_only_with_a_token_for_that_file_cluster_and_machine(model, cluster, client, settings, tmp_path):
    settings.DATA_DIR = tmp_path
    weights = model.files.get(path="config.json")
    disk.ensure_dirs()
    disk.blob_path(weights.sha256).write_bytes(b"x" * weights.size)
    member = cluster.members.get(machine__name="lab-a")
    token = machine_files.file_token(machine_files.FileGrant(digest=weights.sha256, cluster_id=cluster.pk, machine_id=member.machine_id), 60)
    url = f"/agent/models/{weights.sha256}/"

    assert client.get(url).status_code == 401
    assert client.get(f"/agent/models/{'2' * 64}/", HTTP_AUTHORIZATION=f"Bearer {token}").json()["error"] == "This token is for another file."
    ranged = client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}", HTTP_RANGE="bytes=100-199")
    assert ranged.status_code == 206 and b"".join(ranged.streaming_content) == b"x" * 100
    member.delete()
    assert "no longer in it" in client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}").json()["error"]


def test_a_machine_the_files_do_not_reach_is_named_and_keeps_its_place_in_the_cluster(model, monkeypatch):
    cluster = cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)])  # running: Ray is not touched
    FakeAgents().install(monkeypatch)
    whole = FakeAgent.file_fetch

    def fetch(agent, spec, source, **kwargs):
        if agent.machine.name == "lab-b":
            raise AgentError("the source stopped answering", kind=ErrorKind.UNREACHABLE)
        return whole(agent, spec, source, **kwargs)

    monkeypatch.setattr(FakeAgent, "file_fetch", fetch)
    job = copy(model, cluster)
    assert job.state == "failed" and "lab-b: the source stopped answering" in job.error
    assert set(cluster.members.values_list("state", flat=True)) == {MemberState.JOINED}
    assert list(ModelHolding.objects.values_list("machine__name", flat=True)) == ["lab-a"]


def test_a_model_removed_from_the_machines_is_sent_again_by_the_next_copy(model, cluster, monkeypatch):
    fakes = FakeAgents().install(monkeypatch)
    assert copy(model, cluster).state == "succeeded"
    services.model_remove_from_machines(model, user=UserFactory(role=roles.OPERATOR))
    assert not ModelHolding.objects.exists() and not Transfer.objects.filter(digest="2" * 64).exists()
    fakes.calls.clear()

    services.model_copy(model, cluster, user=UserFactory(role=roles.OPERATOR))
    assert Job.objects.filter(kind=machine_files.KIND).latest("created_at").state == "succeeded"
    assert {name for name, method, kw in fakes.calls if method == "file_fetch" and "2222" in kw["url"]} == {"lab-a", "lab-b", "lab-c"}
