"""The Deployments pages: Deploy a model with its plan before anything starts, a deployment's page, its
buttons, the list, the cluster's card and a machine's card, for an Operator and a Viewer."""
import re

import pytest

from console import live, roles
from deployments.choices import CopyState
from deployments.models import Deployment
from tests.builders import cluster_of, gpu_machine, ready_model
from tests.factories import UserFactory
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # copies start from a pool of threads


@pytest.fixture
def cluster():
    return cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)])


@pytest.fixture
def model():
    model = ready_model("org/chat", weight_bytes=30 * 2**30, context_length=8192)
    model.facts |= {"gpu_memory_bytes": 36 * 2**30, "gpu_memory_rule": "weights + 20 % for the KV cache"}
    model.save()
    return model


@pytest.fixture
def operator_client(client):
    client.force_login(UserFactory(username="ops", role=roles.OPERATOR))
    return client


def form(cluster, model, **changes) -> dict:
    return {"cluster": cluster.pk, "model": model.pk, "name": "chat", "copies": "2",
            "kind": "nvidia|H100 80GB|81559|x86_64", "gpu_quarters": "4", "memory_per_gpu_gib": "72",
            "context_length": "4096", "engine_options": ""} | changes


def test_the_form_suggests_the_kind_the_gpus_and_the_memory_for_the_chosen_cluster_and_model(operator_client, cluster, model):
    html = operator_client.get(f"/deployments/new/?cluster={cluster.pk}&model={model.pk}").content.decode()
    assert 'value="nvidia|H100 80GB|81559|x86_64" selected' in html
    assert "H100 80GB · x86_64 — 16 of 16 free on 2 machines" in html
    assert re.search(r'<option value="2" selected>Half a GPU</option>', html)  # 36 GiB fit in half an H100
    assert 'name="memory_per_gpu_gib" type="number" min="0.1" step="0.1" required value="36.0"' in html
    assert 'name="name" class="mono" required maxlength="63" value="chat"' in html
    assert "needs <strong>36.0 GB</strong>" in html.replace("\xa0", " ")


def test_the_plan_names_each_copy_s_machine_and_gpus_or_why_it_cannot_go(operator_client, cluster, model):
    html = operator_client.post("/deployments/plan/", form(cluster, model, copies="3", gpu_quarters="32"),
                                HTTP_HX_REQUEST="true").content.decode()
    assert html.count("GPUs 0, 1, 2, 3, 4, 5, 6, 7") == 2
    assert "Cannot be placed" in html and "no machine has 8 free H100 80GB" in html
    assert "Deploy the 2 that fit and queue 1" in html
    assert not Deployment.objects.exists()


def test_the_plan_refuses_a_bad_field_in_words_next_to_it(operator_client, cluster, model):
    html = operator_client.post("/deployments/plan/", form(cluster, model, copies="many", name="bad name"),
                                HTTP_HX_REQUEST="true").content.decode()
    assert "The number of copies must be a whole number" in html
    response = operator_client.post("/deployments/plan/", form(cluster, model, name="bad name"))
    assert response.status_code == 400 and "A name clients use" in response.content.decode()


def test_deploy_leads_to_the_deployment_s_page_with_its_copies_serving(operator_client, cluster, model, monkeypatch):
    FakeAgents().install(monkeypatch)
    response = operator_client.post("/deployments/create/", form(cluster, model))
    deployment = Deployment.objects.get(name="chat")
    assert response.status_code == 302 and response["Location"] == f"/deployments/{deployment.pk}/"
    html = operator_client.get(response["Location"]).content.decode()
    assert html.count("badge--green\">Serving</span>") == 3  # the header and both copies
    assert "198.18.1.11:8100" in html and "198.18.1.12:8100" in html

    cluster_html = operator_client.get(f"/clusters/{cluster.pk}/").content.decode()
    assert "2 of 2 serving" in cluster_html
    assert re.search(r'Free accelerators</span><span class="stat__value">14<', cluster_html)
    machine_html = operator_client.get(f"/machines/{deployment.copy_rows.first().machine_id}/").content.decode()
    assert "Copies of models on it" in machine_html and "chat #1" in machine_html

    operator_client.post(f"/deployments/{deployment.pk}/scale/", {"copies": "1"})
    assert list(deployment.copy_rows.values_list("number", "state")) == [(1, CopyState.SERVING)]
    list_html = operator_client.get("/deployments/").content.decode()
    assert "1 of 1 serving" in list_html and "1 GPU of H100 80GB (x86_64)" in list_html

    response = operator_client.post(f"/deployments/{deployment.pk}/delete/")
    assert not Deployment.objects.exists()


def test_a_viewer_sees_the_pages_with_every_button_greyed_and_is_refused_a_post(client, cluster, model, monkeypatch):
    FakeAgents().install(monkeypatch)
    operator = UserFactory(username="ops", role=roles.OPERATOR)
    from deployments import services
    from deployments.forms import ask_from

    deployment = services.deployment_create(ask=ask_from(form(cluster, model)), user=operator)
    client.force_login(UserFactory(username="viewer", role=roles.VIEWER))
    html = client.get(f"/deployments/{deployment.pk}/").content.decode()
    assert 'data-dialog-open="delete-dialog"' not in html and "<fieldset disabled" in html
    why = "Your role is Viewer: deploying models needs an Operator."
    assert f'<span class="btn-wrap" title="{why}"><button class="btn btn--primary" type="button" disabled>Deploy a model' in client.get("/deployments/").content.decode()
    assert f'<fieldset disabled title="{why}">' in client.get(f"/deployments/new/?cluster={cluster.pk}&model={model.pk}").content.decode()
    assert client.post(f"/deployments/{deployment.pk}/scale/", {"copies": "3"}).status_code == 403
    assert client.post("/deployments/create/", form(cluster, model, name="other")).status_code == 403


def test_the_live_topics_render_the_list_and_the_page(cluster, model, monkeypatch):
    FakeAgents().install(monkeypatch)
    from deployments import services
    from deployments.forms import ask_from

    deployment = services.deployment_create(ask=ask_from(form(cluster, model)), user=UserFactory(role=roles.OPERATOR))
    header, main = live.render_topic(f"deployment:{deployment.pk}", "", roles.VIEWER)
    assert 'id="deployment-header" hx-swap-oob="true"' in header and "2 of 2 serving" in main
    assert 'id="deployment-main" class="stack" hx-swap-oob="true"' in main and "csrfmiddlewaretoken" not in header + main
    rows = live.render_topic("deployments", "", roles.VIEWER)[0]
    assert 'id="deployment-rows" hx-swap-oob="true"' in rows
    pk = deployment.pk
    deployment.delete()
    assert "This deployment was deleted" in live.render_topic(f"deployment:{pk}", "", roles.VIEWER)[0]


def test_a_model_not_in_the_store_is_added_from_the_form_and_chosen(operator_client, cluster, model, monkeypatch):
    from deployments.models import StoredModel
    from deployments.store import services

    started = []
    monkeypatch.setattr(services, "_download_start", lambda m, user: started.append(m.repo))
    response = operator_client.post("/deployments/new/model/", {"cluster": cluster.pk, "repo": " org/new-chat ", "revision": ""})
    added = StoredModel.objects.get(repo="org/new-chat")
    assert added.revision == "main" and started == ["org/new-chat"]
    assert response.status_code == 302 and response["Location"] == f"/deployments/new/?cluster={cluster.pk}&model={added.pk}"
    # One already in the store is chosen, not added twice.
    again = operator_client.post("/deployments/new/model/", {"cluster": cluster.pk, "repo": "org/chat"})
    assert again["Location"] == f"/deployments/new/?cluster={cluster.pk}&model={model.pk}" and started == ["org/new-chat"]


def test_a_bad_repository_in_the_form_says_why_and_adds_nothing(operator_client, cluster, model, monkeypatch):
    from deployments.models import StoredModel
    from deployments.store import services

    monkeypatch.setattr(services, "_download_start", lambda m, user: pytest.fail("nothing may start"))
    response = operator_client.post("/deployments/new/model/", {"cluster": cluster.pk, "repo": "../etc/passwd"})
    html = response.content.decode()
    assert response.status_code == 400 and 'id="deploy-repo" name="repo"' in html and "../etc/passwd" in html
    assert re.search(r'field--error">\s*<label for="deploy-repo">', html) and 'class="field__error"' in html
    assert StoredModel.objects.count() == 1
    viewer = UserFactory(username="viewer", role=roles.VIEWER)
    operator_client.force_login(viewer)
    assert operator_client.post("/deployments/new/model/", {"repo": "org/other"}).status_code == 403
    assert StoredModel.objects.count() == 1


# -- Change: how each copy runs, its copies replaced one at a time ---------------------------------------


@pytest.fixture
def chat(cluster, model, monkeypatch):
    """A deployment of two copies serving, 1 GPU each, one per machine."""
    FakeAgents().install(monkeypatch)
    from deployments import services
    from deployments.forms import ask_from

    return services.deployment_create(ask=ask_from(form(cluster, model, engine_options="--enable-prefix-caching")),
                                      user=UserFactory(role=roles.OPERATOR))


def change_form(**changes) -> dict:
    """The Change form as it comes, filled with what the deployment has now."""
    return {"kind": "nvidia|H100 80GB|81559|x86_64", "gpu_quarters": "4", "memory_per_gpu_gib": "72.0",
            "context_length": "4096", "engine_options": "--enable-prefix-caching"} | changes


def test_the_change_form_comes_filled_with_what_the_deployment_runs_with(operator_client, chat):
    page = operator_client.get(f"/deployments/{chat.pk}/").content.decode()
    assert f'<a class="btn" href="/deployments/{chat.pk}/change/">Change</a>' in page
    html = operator_client.get(f"/deployments/{chat.pk}/change/").content.decode()
    assert 'value="nvidia|H100 80GB|81559|x86_64" selected' in html
    assert '<option value="4" selected>1 GPU</option>' in html
    assert 'name="memory_per_gpu_gib" type="number" min="0.1" step="0.1" required value="72.0"' in html
    assert 'name="context_length" type="number" min="16" required value="4096"' in html
    assert ">--enable-prefix-caching</textarea>" in html
    assert "Copies are replaced one at a time: each new copy serves before an old one stops." in html


def test_the_change_s_plan_shows_where_each_replacement_goes_beside_the_copies_still_serving(operator_client, chat):
    html = operator_client.post(f"/deployments/{chat.pk}/change/plan/", change_form(gpu_quarters="8"),
                                HTTP_HX_REQUEST="true").content.decode()
    assert html.lstrip().startswith('<section class="card" id="change-plan"') and "2 of 2 replacements placed" in html
    assert html.count("GPUs 1, 2") == 2, "each beside its old copy, which holds GPU 0 until its replacement serves"

    html = operator_client.post(f"/deployments/{chat.pk}/change/plan/", change_form(gpu_quarters="32"),
                                HTTP_HX_REQUEST="true").content.decode()
    assert "no machine has 8 free H100 80GB" in html and "Not replaced: the change stops at #1" in html
    assert list(chat.copy_rows.values_list("number", flat=True)) == [1, 2]  # nothing was written

    html = operator_client.post(f"/deployments/{chat.pk}/change/plan/", change_form(), HTTP_HX_REQUEST="true").content.decode()
    assert "Nothing to change" in html


def test_a_bad_value_is_refused_next_to_its_field_and_changes_nothing(operator_client, chat):
    from console.models import Job

    jobs = Job.objects.count()
    response = operator_client.post(f"/deployments/{chat.pk}/change/", change_form(context_length="99999"))
    assert response.status_code == 400
    assert "The context length must be from 16 to the model&#x27;s 8,192 tokens." in response.content.decode()
    assert 'value="99999"' in response.content.decode(), "what was typed stays, to be fixed"
    response = operator_client.post(f"/deployments/{chat.pk}/change/", change_form(memory_per_gpu_gib="lots"))
    assert response.status_code == 400 and "must be a number of GiB, not &#x27;lots&#x27;" in response.content.decode()

    chat.refresh_from_db()
    assert (chat.generation, chat.context_length, chat.memory_per_gpu_mib) == (1, 4096, 72 * 1024)
    assert Job.objects.count() == jobs


def test_a_form_sent_back_as_it_came_says_so_and_restarts_nothing(operator_client, chat):
    from console.models import Job

    jobs = Job.objects.count()
    response = operator_client.post(f"/deployments/{chat.pk}/change/", change_form())
    assert response.status_code == 200 and "Nothing to change" in response.content.decode()
    chat.refresh_from_db()
    assert chat.generation == 1 and Job.objects.count() == jobs
    assert list(chat.copy_rows.values_list("number", "state")) == [(1, CopyState.SERVING), (2, CopyState.SERVING)]


def test_a_change_goes_through_the_service_and_replaces_the_copies(operator_client, chat, monkeypatch):
    from deployments import services

    called = []
    change = services.deployment_change
    monkeypatch.setattr(services, "deployment_change", lambda **kw: called.append(kw["ask"]) or change(**kw))

    response = operator_client.post(f"/deployments/{chat.pk}/change/", change_form(context_length="2048"))
    assert response.status_code == 302 and response["Location"] == f"/deployments/{chat.pk}/"
    assert [ask.context_length for ask in called] == [2048]
    chat.refresh_from_db()
    assert (chat.generation, chat.context_length, chat.memory_per_gpu_mib) == (2, 2048, 72 * 1024)
    assert list(chat.copy_rows.values_list("number", "generation", "state")) == [
        (3, 2, CopyState.SERVING), (4, 2, CopyState.SERVING)]
    assert "Changing chat: its copies are replaced one at a time" in operator_client.get(response["Location"]).content.decode()


def test_a_viewer_sees_change_greyed_and_is_refused_its_post(client, chat):
    client.force_login(UserFactory(username="viewer", role=roles.VIEWER))
    why = "Your role is Viewer: deploying models needs an Operator."
    page = client.get(f"/deployments/{chat.pk}/").content.decode()
    assert f'<span class="btn-wrap" title="{why}"><button class="btn" type="button" disabled>Change</button>' in page
    assert f'<fieldset disabled title="{why}">' in client.get(f"/deployments/{chat.pk}/change/").content.decode()
    assert client.post(f"/deployments/{chat.pk}/change/", change_form(context_length="2048")).status_code == 403
    chat.refresh_from_db()
    assert (chat.generation, chat.context_length) == (1, 4096)
