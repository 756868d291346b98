"""A deployment's routing in the REST API: set when deploying, changed with PATCH without restarting any copy,
refused in words when it is not one of the two; a Viewer may not change it."""
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
def ask(monkeypatch) -> dict:
    FakeAgents().install(monkeypatch)
    cluster = cluster_of([gpu_machine("lab-a", 11)])
    model = ready_model("org/chat", weight_bytes=10 * 2**30, context_length=8192)
    return {"cluster": cluster.pk, "model": model.pk, "name": "chat", "copies": 2}


def test_routing_is_least_busy_unless_asked_and_changes_without_restarting_a_copy(ask):
    operator = client_for(roles.OPERATOR)
    plain = operator.post("/api/deployments/", ask, format="json")
    assert plain.status_code == 202 and plain.json()["routing"] == "least-busy"
    aware = operator.post("/api/deployments/", ask | {"name": "aware", "routing": "cache-aware"}, format="json")
    assert aware.status_code == 202 and aware.json()["routing"] == "cache-aware"
    assert Deployment.objects.get(name="aware").routing == "cache-aware"

    pk = plain.json()["id"]
    before = [(c["number"], c["state"]) for c in plain.json()["copy_rows"]]
    changed = operator.patch(f"/api/deployments/{pk}/", {"routing": "cache-aware"}, format="json")
    assert changed.status_code == 202 and changed.json()["routing"] == "cache-aware"
    assert [(c["number"], c["state"]) for c in changed.json()["copy_rows"]] == before, "no copy was replaced"
    assert Deployment.objects.get(pk=pk).generation == 1
    listed = {d["name"]: d["routing"] for d in operator.get("/api/deployments/").json()["results"]}
    assert listed == {"aware": "cache-aware", "chat": "cache-aware"}

    both = operator.patch(f"/api/deployments/{pk}/", {"routing": "least-busy", "context_length": 4096}, format="json")
    assert both.status_code == 202 and both.json()["routing"] == "least-busy" and both.json()["context_length"] == 4096
    assert Deployment.objects.get(pk=pk).generation == 2, "the context length replaced the copies, the routing did not"


def test_a_routing_that_is_not_one_is_refused_in_words_and_changes_nothing(ask):
    operator = client_for(roles.OPERATOR)
    refused = operator.post("/api/deployments/", ask | {"routing": "round-robin"}, format="json")
    assert refused.status_code == 400
    assert refused.json()["errors"]["routing"] == ["Routing is least-busy or cache-aware, not 'round-robin'."]
    assert not Deployment.objects.exists()

    pk = operator.post("/api/deployments/", ask, format="json").json()["id"]
    refused = operator.patch(f"/api/deployments/{pk}/", {"routing": "fastest"}, format="json")
    assert refused.status_code == 400
    assert refused.json()["errors"]["routing"] == ["Routing is least-busy or cache-aware, not 'fastest'."]
    assert client_for(roles.VIEWER).patch(f"/api/deployments/{pk}/", {"routing": "cache-aware"}, format="json").status_code == 403
    assert Deployment.objects.get(pk=pk).routing == "least-busy"
