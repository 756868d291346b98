"""REST for models and a cluster's model source: answers, refusals in words, roles."""
import pytest
from rest_framework.test import APIClient

from clusters.choices import ModelSource
from console import roles
from console.models import Job
from deployments.choices import ModelState
from deployments.models import ModelFile, ModelHolding, StoredModel
from tests.builders import cluster_of, gpu_machine
from tests.factories import MachineFactory, UserFactory

pytestmark = pytest.mark.django_db


def client_for(role) -> APIClient:
    client = APIClient()
    client.force_authenticate(UserFactory(role=role))
    return client


@pytest.fixture
def ready_model():
    model = StoredModel.objects.create(repo="org/tiny", commit="c" * 40, state=ModelState.READY, bytes_total=10,
                                       bytes_done=10, facts={"architecture": "LlamaForCausalLM"})
    ModelFile.objects.create(model=model, path="config.json", size=10, sha256="a" * 64)
    return model


def test_adding_a_model_starts_its_download_and_answers_its_progress(django_capture_on_commit_callbacks, monkeypatch):
    sent = []
    monkeypatch.setattr("deployments.tasks.model_download.delay", lambda job_id: sent.append(job_id))
    with django_capture_on_commit_callbacks(execute=True):
        answer = client_for(roles.OPERATOR).post("/api/models/", {"repo": "org/new-model"}, format="json")
    assert answer.status_code == 202, answer.json()
    body = answer.json()
    assert body["repo"] == "org/new-model" and body["revision"] == "main" and body["state"] == "downloading"
    assert set(body["progress"]) == {"bytes_done", "bytes_total", "percent", "rate", "seconds_left"}
    assert sent == [Job.objects.get(kind="model.download", target_id=body["id"]).pk]


@pytest.mark.parametrize("body, words", [
    ({"repo": "not a repo"}, "is not a repository id"),
    ({"repo": "org/x", "revision": "../../etc"}, "is not a revision"),
    ({}, "repo: This field is required."),
])
def test_bad_input_is_refused_in_words_and_nothing_is_recorded(body, words):
    answer = client_for(roles.OPERATOR).post("/api/models/", body, format="json")
    assert answer.status_code == 400 and words in answer.json()["message"]
    assert not StoredModel.objects.exists()


def test_a_viewer_reads_models_but_may_not_add_or_delete(ready_model):
    viewer = client_for(roles.VIEWER)
    assert viewer.get("/api/models/").json()["results"][0]["repo"] == "org/tiny"
    detail = viewer.get(f"/api/models/{ready_model.pk}/").json()
    assert detail["files"][0]["path"] == "config.json" and detail["held_on"] == []
    refused = viewer.post("/api/models/", {"repo": "org/x"}, format="json")
    assert refused.status_code == 403 and "needs an Operator" in refused.json()["message"]
    assert viewer.delete(f"/api/models/{ready_model.pk}/").status_code == 403


def test_deleting_a_model_machines_hold_is_refused_and_says_where(ready_model):
    ModelHolding.objects.create(model=ready_model, machine=MachineFactory(name="gpu-7"))
    answer = client_for(roles.OPERATOR).delete(f"/api/models/{ready_model.pk}/")
    assert answer.status_code == 400 and "gpu-7 still holds org/tiny's files" in answer.json()["message"]
    assert StoredModel.objects.filter(pk=ready_model.pk).exists()


def test_copy_to_needs_a_cluster_that_exists(ready_model):
    answer = client_for(roles.OPERATOR).post(f"/api/models/{ready_model.pk}/copy-to/", {"cluster": 999}, format="json")
    assert answer.status_code == 400 and "There is no such cluster" in answer.json()["message"]


def test_the_cluster_model_source_is_read_and_a_bad_one_refused():
    cluster = cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)])
    operator = client_for(roles.OPERATOR)
    assert operator.get(f"/api/clusters/{cluster.pk}/").json()["model_source"] == ModelSource.SERVER
    bad = operator.patch(f"/api/clusters/{cluster.pk}/", {"model_source": "internet"}, format="json")
    assert bad.status_code == 400 and "model_source" in bad.json()["message"]
    viewer = client_for(roles.VIEWER).patch(f"/api/clusters/{cluster.pk}/", {"model_source": "server"}, format="json")
    assert viewer.status_code == 403
