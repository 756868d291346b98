"""REST for deployments: plan, deploy (with what is left out suggested), copies, scale, delete, the cluster's
deployments and free accelerators; refusals in words; roles."""
import pytest
from rest_framework.test import APIClient

from console import roles
from deployments.models import Deployment
from tests.builders import cluster_of, gpu_machine, ready_model
from tests.factories import UserFactory
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # copies start from a pool of threads


def client_for(role) -> APIClient:
    client = APIClient()
    client.force_authenticate(UserFactory(role=role))
    return client


@pytest.fixture
def cluster():
    return cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)])


@pytest.fixture
def model():
    model = ready_model("org/chat", weight_bytes=60 * 2**30, context_length=8192)
    model.facts["gpu_memory_bytes"] = 72 * 2**30
    model.save()
    return model


@pytest.fixture
def fakes(monkeypatch):
    return FakeAgents().install(monkeypatch)


def test_the_plan_suggests_what_is_left_out_and_writes_nothing(cluster, model):
    answer = client_for(roles.OPERATOR).post("/api/deployments/plan/", {"cluster": cluster.pk, "model": model.pk,
                                                                       "name": "chat", "copies": 3}, format="json")
    assert answer.status_code == 200, answer.json()
    rows = answer.json()
    assert [len(r["slots"][0]["gpus"]) for r in rows] == [1, 1, 1]  # 72 GiB: one H100 each
    assert {r["machine"] for r in rows} == {"lab-a", "lab-b"}
    assert not Deployment.objects.exists()


def test_deploy_answers_the_deployment_with_its_copies_and_the_cluster_counts_what_they_hold(cluster, model, fakes):
    client = client_for(roles.OPERATOR)
    answer = client.post("/api/deployments/", {"cluster": cluster.pk, "model": model.pk, "name": "chat", "copies": 2,
                                               "gpus_per_copy": 2, "engine_options": ["--enable-prefix-caching"]},
                         format="json")
    assert answer.status_code == 202, answer.json()
    body = answer.json()
    assert body["gpus_per_copy"] == 2.0 and body["gpu_kind"] == {"vendor": "nvidia", "model": "H100 80GB", "memory_mib": 81559}
    assert [c["state"] for c in body["copy_rows"]] == ["serving", "serving"]
    assert body["memory_per_gpu_mib"] == int(81559 * 0.9) and body["context_length"] == 8192

    detail = client.get(f"/api/clusters/{cluster.pk}/").json()
    assert detail["free_accelerators"] == 12 and detail["deployments"] == [
        {"id": body["id"], "name": "chat", "model": "org/chat", "copies": 2, "serving": 2}]
    copies = client.get(f"/api/deployments/{body['id']}/copies/").json()
    assert [c["machine"] for c in copies] == sorted(c["machine"] for c in copies) and len(copies) == 2

    scaled = client.patch(f"/api/deployments/{body['id']}/", {"copies": 3}, format="json")
    assert scaled.status_code == 202 and [c["state"] for c in scaled.json()["copy_rows"]] == ["serving"] * 3
    refused = client.patch(f"/api/deployments/{body['id']}/", {"context_length": 10**6, "cluster": 3}, format="json")
    assert refused.status_code == 400 and "Not a field a deployment can change" in refused.json()["errors"]["cluster"][0]
    refused = client.patch(f"/api/deployments/{body['id']}/", {"context_length": 10**6}, format="json")
    assert refused.status_code == 400 and "from 16 to the model's 8,192 tokens" in refused.json()["errors"]["context_length"][0]
    before = {c["number"] for c in client.get(f"/api/deployments/{body['id']}/copies/").json()}
    changed = client.patch(f"/api/deployments/{body['id']}/", {"context_length": 4096}, format="json")
    assert changed.status_code == 202, changed.json()
    after = changed.json()["copy_rows"]  # each replaced by a new copy, Serving before the old one stopped
    assert len(after) == 3 and not before & {c["number"] for c in after}
    assert {c["state"] for c in after} == {"serving"} and changed.json()["context_length"] == 4096

    listed = client.get("/api/deployments/").json()
    assert listed["results"][0]["serving"] == 3

    deleted = client.delete(f"/api/deployments/{body['id']}/")
    assert deleted.status_code == 202 and not Deployment.objects.exists()


def test_copies_that_do_not_fit_are_refused_with_the_plan_s_reasons(cluster, model, fakes):
    answer = client_for(roles.OPERATOR).post("/api/deployments/", {"cluster": cluster.pk, "model": model.pk, "name": "big",
                                                                   "copies": 3, "gpus_per_copy": 8}, format="json")
    assert answer.status_code == 400
    assert "2 of 3 copies fit" in str(answer.json()) and "no machine has 8 free H100 80GB" in str(answer.json())


@pytest.mark.parametrize("body, field, words", [
    ({"name": "bad name"}, "name", "A name clients use"),
    ({"gpus_per_copy": 3}, "gpus_per_copy", "A copy takes 0.25 or 0.5 of a GPU"),
    ({"engine_options": ["--port=9"]}, "engine_options", "--port is set by the console"),
    ({"engine_options": "--x"}, "engine_options", "Expected a list"),
    ({"gpu_kind": "nonsense"}, "kind", "Pick the kind of GPU"),
    ({"model": None, "repo": None}, "model", "Give a model from the store"),
    ({"cluster": 999}, "cluster", "There is no such cluster"),
])
def test_bad_input_is_refused_in_words_and_nothing_is_written(cluster, model, body, field, words):
    answer = client_for(roles.OPERATOR).post(
        "/api/deployments/", {k: v for k, v in ({"cluster": cluster.pk, "model": model.pk, "name": "chat"} | body).items()
                              if v is not None}, format="json")
    assert answer.status_code == 400, answer.json()
    assert words in " ".join(answer.json()["errors"][field]), answer.json()
    assert not Deployment.objects.exists()


def test_a_viewer_reads_but_may_not_deploy_scale_or_delete(cluster, model, fakes):
    operator = client_for(roles.OPERATOR)
    pk = operator.post("/api/deployments/", {"cluster": cluster.pk, "model": model.pk, "name": "chat"}, format="json").json()["id"]
    viewer = client_for(roles.VIEWER)
    assert viewer.get(f"/api/deployments/{pk}/").status_code == 200
    assert viewer.post("/api/deployments/", {"cluster": cluster.pk, "model": model.pk, "name": "x"}, format="json").status_code == 403
    assert viewer.patch(f"/api/deployments/{pk}/", {"copies": 2}, format="json").status_code == 403
    assert viewer.delete(f"/api/deployments/{pk}/").status_code == 403
