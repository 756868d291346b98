"""REST for models running without a deployment: a cluster's orphans, Look for them, Take over one (keep or
delete); refusals in words, roles (Operator)."""
import pytest

from console import roles
from deployments import services
from deployments.models import Deployment
from tests.builders import ready_model
from tests.factories import UserFactory
from tests.api.test_deployments_api import client_for, cluster, fakes  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)  # copies start from a pool of threads


@pytest.fixture
def orphaned(cluster, fakes):
    """"chat", 2 copies of 2 GPUs, deleted while no machine could be reached: it runs on without a deployment."""
    operator = UserFactory(role=roles.OPERATOR)
    deployment = services.deployment_create(ask=services.DeployAsk(
        cluster=cluster, model=ready_model("org/chat"), name="chat", copies=2, gpu_quarters=8, vendor="nvidia",
        gpu_model="NVIDIA H100 80GB HBM3", gpu_memory_mib=81559, arch="x86_64", memory_per_gpu_mib=70000,
        context_length=4096), user=operator)
    for name in ("lab-a", "lab-b"):
        fakes.answers.setdefault(name, {})["error"] = "ssh: connect to host: No route to host"
    services.deployment_delete(deployment=deployment, user=operator)
    for name in ("lab-a", "lab-b"):
        fakes.answers[name].pop("error")
    return Deployment.objects.get(pk=deployment.pk)


def test_a_clusters_orphans_are_listed_and_no_longer_among_its_deployments(cluster, orphaned):
    viewer = client_for(roles.VIEWER)
    answer = viewer.get(f"/api/clusters/{cluster.pk}/orphans/")
    assert answer.status_code == 200, answer.content
    [chat] = answer.json()["orphans"]
    assert (chat["name"], chat["known"], chat["gpus"], chat["keep_refusal"]) == ("chat", True, 4, None)
    assert sorted(e["machine"] for e in chat["engines"]) == ["lab-a", "lab-b"]
    assert answer.json()["last_look"] is None
    assert viewer.get(f"/api/clusters/{cluster.pk}/").json()["deployments"] == []
    assert viewer.get("/api/deployments/").json()["results"] == []
    assert viewer.get(f"/api/deployments/{orphaned.pk}/").status_code == 404


def test_look_for_them_then_keep_one_as_it_runs(cluster, orphaned, fakes):
    operator = client_for(roles.OPERATOR)
    pids = dict(orphaned.copy_rows.values_list("number", "pid"))
    answer = operator.post(f"/api/clusters/{cluster.pk}/orphans/look/")
    assert answer.status_code == 202, answer.content
    look = operator.get(f"/api/clusters/{cluster.pk}/orphans/").json()["last_look"]
    assert (look["job"], look["state"], look["not_asked"]) == (answer.json()["job"], "succeeded", [])

    answer = operator.post(f"/api/clusters/{cluster.pk}/orphans/take-over/", {"name": "chat", "keep": True}, format="json")
    assert answer.status_code == 202, answer.content
    assert operator.get(f"/api/clusters/{cluster.pk}/orphans/").json()["orphans"] == []
    kept = operator.get(f"/api/deployments/{orphaned.pk}/")
    assert kept.status_code == 200 and kept.json()["name"] == "chat"
    assert {c["number"]: c["pid"] for c in operator.get(f"/api/deployments/{orphaned.pk}/copies/").json()} == pids


def test_delete_one_properly_frees_its_gpus(cluster, orphaned, fakes):
    operator = client_for(roles.OPERATOR)
    answer = operator.post(f"/api/clusters/{cluster.pk}/orphans/take-over/", {"name": "chat", "keep": False}, format="json")
    assert answer.status_code == 202, answer.content
    assert not Deployment.objects.exists()
    assert not any(fakes.copies.get(name) for name in ("lab-a", "lab-b"))


def test_refusals_in_words_and_roles(cluster, orphaned):
    viewer = client_for(roles.VIEWER)
    assert viewer.post(f"/api/clusters/{cluster.pk}/orphans/look/").status_code == 403
    answer = viewer.post(f"/api/clusters/{cluster.pk}/orphans/take-over/", {"name": "chat", "keep": False}, format="json")
    assert answer.status_code == 403 and "needs an Operator" in answer.json()["message"]
    operator = client_for(roles.OPERATOR)
    answer = operator.post(f"/api/clusters/{cluster.pk}/orphans/take-over/", {"name": "nothing", "keep": False}, format="json")
    assert answer.status_code == 400 and "No model runs on gpu-room without a deployment under that name" in answer.json()["message"]
    answer = operator.post(f"/api/clusters/{cluster.pk}/orphans/take-over/", {"keep": "maybe"}, format="json")
    assert answer.status_code == 400 and set(answer.json()["errors"]) == {"name", "keep"}
