"""REST for a machine's drain: Drain with the plan agreed to, the drain's state in the machine's answer and the
list's, Stop drain, Remove from cluster and Cancel removal; an Operator's, refused in the product's words."""
import pytest
from rest_framework.test import APIClient

from console import roles
from deployments import drain_job
from deployments.choices import DrainState
from deployments.models import Drain
from tests.builders import cluster_of, gpu_machine
from tests.factories import UserFactory
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)


def client_for(role) -> APIClient:
    client = APIClient()
    client.force_authenticate(UserFactory(role=role))
    return client


@pytest.fixture
def cluster(monkeypatch, settings):
    settings.FADEN_DRAIN_GRACE = 0
    monkeypatch.setattr(drain_job, "routes_read_since", lambda since, **kw: None)
    FakeAgents().install(monkeypatch)
    return cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)])


def test_an_operator_drains_a_machine_reads_its_state_and_stops_the_drain(cluster, monkeypatch):
    worker = cluster.members.get(role="worker").machine
    operator = client_for(roles.OPERATOR)

    answer = operator.post(f"/api/machines/{worker.pk}/drain/", {"plan": {"moves": [], "stops": []}}, format="json")

    assert answer.status_code == 202, answer.json()
    assert answer.json()["machine"] == worker.pk
    shown = operator.get(f"/api/machines/{worker.pk}/").json()["drain"]
    assert (shown["state"], shown["state_label"], shown["remove"]) == (DrainState.DRAINED, "Drained", False)
    listed = {row["name"]: row["drain"] for row in operator.get("/api/machines/").json()["results"]}
    assert listed["lab-a"] is None and listed["lab-b"]["state"] == DrainState.DRAINED
    assert operator.get(f"/api/machines/{worker.pk}/drain/").json()["state"] == DrainState.DRAINED

    monkeypatch.setattr("clusters.services.cluster_rejoin", lambda **kw: None)
    stopped = operator.post(f"/api/machines/{worker.pk}/stop-drain/")
    assert stopped.status_code == 202 and stopped.json()["state"] == DrainState.STOPPING


def test_the_head_is_refused_in_words_a_viewer_gets_a_403_and_a_bad_plan_a_400(cluster):
    head = cluster.members.get(role="head").machine
    worker = cluster.members.get(role="worker").machine
    operator = client_for(roles.OPERATOR)
    refused = operator.post(f"/api/machines/{head.pk}/drain/", {"plan": {}}, format="json")
    assert refused.status_code == 400
    assert "the cluster cannot run without it. Stop the cluster instead, or drain the other machines." in str(refused.json())
    assert client_for(roles.VIEWER).post(f"/api/machines/{worker.pk}/drain/", {"plan": {}}, format="json").status_code == 403
    bad = operator.post(f"/api/machines/{worker.pk}/drain/", {"plan": {"moves": [{"copy": "one"}]}}, format="json")
    assert bad.status_code == 400 and "names its copy" in str(bad.json())
    assert operator.get(f"/api/machines/{worker.pk}/drain/").status_code == 404
    assert operator.post(f"/api/machines/{worker.pk}/stop-drain/").status_code == 400


def test_remove_from_a_running_cluster_drains_then_the_machine_leaves_and_cancel_is_refused_once_it_has(cluster):
    worker = cluster.members.get(role="worker").machine
    operator = client_for(roles.OPERATOR)

    answer = operator.post(f"/api/machines/{worker.pk}/remove-from-cluster/", {"plan": {}}, format="json")

    assert answer.status_code == 202, answer.json()
    assert answer.json()["drain"]["remove"] is True and answer.json()["job"] is None
    assert not cluster.members.filter(machine=worker).exists() and not Drain.objects.exists()
    cancelled = operator.post(f"/api/machines/{worker.pk}/cancel-removal/")
    assert cancelled.status_code == 400 and "is not being removed" in str(cancelled.json())
