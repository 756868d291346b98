"""A deployment's routing on the pages: the Deploy form's choice, the deployment page's Routing card (changed
without restarting a copy), refusals in words, and a Viewer refused."""
import pytest

from console import roles
from deployments import services
from deployments.choices import CopyState, Routing
from deployments.forms import ask_from
from deployments.models import Deployment
from tests.builders import cluster_of, gpu_machine, ready_model
from tests.factories import UserFactory
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # copies start from a pool of threads


@pytest.fixture
def cluster():
    return cluster_of([gpu_machine("lab-a", 11)])


@pytest.fixture
def model():
    return ready_model("org/chat", weight_bytes=10 * 2**30, context_length=8192)


@pytest.fixture
def operator_client(client):
    client.force_login(UserFactory(username="ops", role=roles.OPERATOR))
    return client


def form(cluster, model, **changes) -> dict:
    return {"cluster": cluster.pk, "model": model.pk, "name": "chat", "copies": "2",
            "kind": "nvidia|H100 80GB|81559|x86_64", "gpu_quarters": "4", "memory_per_gpu_gib": "72",
            "context_length": "4096", "engine_options": ""} | changes


def test_the_deploy_form_offers_both_routings_and_deploys_the_one_chosen(operator_client, cluster, model, monkeypatch):
    FakeAgents().install(monkeypatch)
    html = operator_client.get(f"/deployments/new/?cluster={cluster.pk}&model={model.pk}").content.decode()
    assert '<select id="deploy-routing" name="routing">' in html
    assert '<option value="least-busy" title="Each request goes to the copy with the fewest requests in flight." selected>' \
           'Least busy</option>' in html
    assert ">Cache-aware</option>" in html

    response = operator_client.post("/deployments/create/", form(cluster, model, routing="cache-aware"))
    assert response.status_code == 302
    deployment = Deployment.objects.get(name="chat")
    assert deployment.routing == Routing.CACHE_AWARE
    page = operator_client.get(response["Location"]).content.decode()
    assert "routed cache-aware" in page
    assert '<option value="cache-aware" selected>Cache-aware</option>' in page


def test_a_bad_routing_in_the_form_is_refused_next_to_its_field(operator_client, cluster, model):
    response = operator_client.post("/deployments/plan/", form(cluster, model, routing="round-robin"))
    html = response.content.decode()
    assert response.status_code == 400
    assert '<p class="field__error">Routing is least-busy or cache-aware, not &#x27;round-robin&#x27;.</p>' in html
    response = operator_client.post("/deployments/create/", form(cluster, model, routing="round-robin"))
    assert response.status_code == 400 and not Deployment.objects.exists()


def test_the_routing_card_changes_it_without_restarting_a_copy(operator_client, cluster, model, monkeypatch):
    FakeAgents().install(monkeypatch)
    deployment = services.deployment_create(ask=ask_from(form(cluster, model)), user=UserFactory(role=roles.OPERATOR))
    copies = list(deployment.copy_rows.values_list("number", "state"))
    assert copies == [(1, CopyState.SERVING), (2, CopyState.SERVING)]

    response = operator_client.post(f"/deployments/{deployment.pk}/routing/", {"routing": "cache-aware"})
    assert response.status_code == 302 and response["Location"] == f"/deployments/{deployment.pk}/"
    deployment.refresh_from_db()
    assert (deployment.routing, deployment.generation) == (Routing.CACHE_AWARE, 1)
    assert list(deployment.copy_rows.values_list("number", "state")) == copies
    page = operator_client.get(response["Location"]).content.decode()
    assert "chat is routed cache-aware now: the gateway takes it within a second, and no copy restarts." in page

    operator_client.post(f"/deployments/{deployment.pk}/routing/", {"routing": "sideways"})
    deployment.refresh_from_db()
    assert deployment.routing == Routing.CACHE_AWARE
    assert "Routing is least-busy or cache-aware, not &#x27;sideways&#x27;." in \
        operator_client.get(f"/deployments/{deployment.pk}/").content.decode()

    # The Change form keeps the routing: it is not one of its fields.
    operator_client.post(f"/deployments/{deployment.pk}/change/", {
        "kind": "nvidia|H100 80GB|81559|x86_64", "gpu_quarters": "4", "memory_per_gpu_gib": "72.0",
        "context_length": "2048", "engine_options": ""})
    deployment.refresh_from_db()
    assert (deployment.context_length, deployment.routing) == (2048, Routing.CACHE_AWARE)


def test_a_viewer_sees_the_routing_card_greyed_and_is_refused_its_post(client, cluster, model, monkeypatch):
    FakeAgents().install(monkeypatch)
    deployment = services.deployment_create(ask=ask_from(form(cluster, model)), user=UserFactory(role=roles.OPERATOR))
    client.force_login(UserFactory(username="viewer", role=roles.VIEWER))
    page = client.get(f"/deployments/{deployment.pk}/").content.decode()
    card = page[page.index('id="deployment-routing"'):page.index('id="deployment-use"')]
    assert '<fieldset disabled title="Your role is Viewer: deploying models needs an Operator.">' in card
    assert client.post(f"/deployments/{deployment.pk}/routing/", {"routing": "cache-aware"}).status_code == 403
    deployment.refresh_from_db()
    assert deployment.routing == Routing.LEAST_BUSY
