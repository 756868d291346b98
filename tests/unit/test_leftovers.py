"""What a deleted cluster leaves on its machines: the Delete page says what stays and where, and the
machine's page frees the runtime images and a former head's /shared, refused while a cluster uses them."""
import re

import pytest
from django.core.exceptions import PermissionDenied, ValidationError

from clusters import leftovers, tasks
from clusters.choices import ClusterState
from clusters.models import Cluster
from console import roles
from console.choices import JobState
from console.models import Job
from machines.choices import MachineState
from tests.builders import cluster_of, gpu_machine
from tests.factories import UserFactory
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator():
    return UserFactory(username="ann", role=roles.OPERATOR)


def disabled_button_why(html: str, label: str) -> str:
    match = re.search(r'<span class="btn-wrap" title="([^"]*)"><button[^>]*disabled>' + re.escape(label) + "</button>", html)
    assert match, f"no disabled {label!r} button"
    return match.group(1).replace("&#x27;", "'")


# -- the Delete page ---------------------------------------------------------------------------------


def test_the_delete_page_says_shared_stays_on_the_head_and_files_and_images_in_each_machines_store(admin_client):
    cluster = cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)])

    html = admin_client.get(f"/clusters/{cluster.pk}/delete/").content.decode()

    stays = re.search(r'<div class="callout callout--info" id="delete-what-stays">.*?</div>', html, re.S).group(0)
    text = re.sub(r"<[^>]+>", "", stays)
    assert "The files in /shared stay on lab-a, which leads gpu-room and holds them" in text
    assert "Model files and runtime images stay in each machine's store (lab-a, lab-b)" in text
    assert "Free them on each machine's page, under Left by deleted clusters" in text


# -- the rules ---------------------------------------------------------------------------------------


def test_a_machine_of_a_running_cluster_keeps_its_image_and_its_shared_saying_why():
    cluster = cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)])
    head = cluster.members.get(machine__name="lab-a").machine

    offers = leftovers.leftovers_offers(head, role=roles.OPERATOR)

    assert offers["images"].why == ("lab-a runs gpu-room's runtime (running): its image stays while the cluster uses "
                                    "it. Stop or delete gpu-room first.")
    assert offers["shared"].why == ("lab-a is in gpu-room: /shared there holds the cluster's files. Delete gpu-room or take "
                                    "lab-a out of it first.")


def test_a_stopped_clusters_machine_may_free_its_images_but_not_its_shared():
    cluster = cluster_of([gpu_machine("lab-a", 11)], state=ClusterState.STOPPED)
    machine = cluster.members.get().machine
    offers = leftovers.leftovers_offers(machine, role=roles.OPERATOR)
    assert offers["images"].ok and not offers["shared"].ok


def test_a_machine_no_cluster_holds_frees_both_and_a_viewer_is_told_the_role_it_needs():
    machine = gpu_machine("lab-a", 11)
    assert all(offer.ok for offer in leftovers.leftovers_offers(machine, role=roles.OPERATOR).values())
    viewer = leftovers.leftovers_offers(machine, role=roles.VIEWER)["images"]
    assert viewer.forbidden and viewer.why == "Your role is Viewer: freeing a machine's runtime images needs an Operator."


@pytest.mark.parametrize("fields, words", [
    ({"state": MachineState.OFFLINE}, "lab-a is offline: its agent must answer."),
    ({"agent_version": "0.8.0"}, "lab-a's agent 0.8.0 is older than 0.9.0: select Update agent first."),
])
def test_a_machine_whose_agent_cannot_do_it_is_refused_in_words(fields, words):
    machine = gpu_machine("lab-a", 11, **fields)
    assert leftovers.leftovers_offers(machine, role=roles.OPERATOR)["shared"].why == words


def test_the_services_refuse_as_the_buttons_do(operator):
    cluster = cluster_of([gpu_machine("lab-a", 11)])
    machine = cluster.members.get().machine
    with pytest.raises(ValidationError) as refused:
        leftovers.machine_shared_free(machine=machine, user=operator)
    assert refused.value.messages == ["lab-a is in gpu-room: /shared there holds the cluster's files. Delete gpu-room or "
                                      "take lab-a out of it first."]
    with pytest.raises(PermissionDenied):
        leftovers.machine_images_free(machine=gpu_machine("lab-b", 12), user=UserFactory(username="vic", role=roles.VIEWER))
    assert not Job.objects.exists()


# -- the jobs ----------------------------------------------------------------------------------------


def test_freeing_the_images_runs_image_remove_and_says_what_it_freed(operator, monkeypatch):
    machine = gpu_machine("lab-a", 11)
    fakes = FakeAgents({"lab-a": {"image_remove": {"removed": [{"digest": "ab" * 32, "size": 2_300_000_000}],
                                                   "kept": [], "freed": 2_300_000_000, "warnings": []}}}).install(monkeypatch)
    job = leftovers.machine_images_free(machine=machine, user=operator)

    tasks.machine_images_free(job.pk)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED and (job.target_type, job.target_id) == ("machine", machine.pk)
    assert [method for _, method, _ in fakes.calls] == ["image_remove"]
    assert "lab-a: 1 runtime image removed, 2.3 GB freed" in job.log


def test_a_cluster_started_on_the_machine_meanwhile_stops_the_job_before_the_agent_is_asked(operator, monkeypatch):
    machine = gpu_machine("lab-a", 11)
    fakes = FakeAgents().install(monkeypatch)
    job = leftovers.machine_shared_free(machine=machine, user=operator)
    cluster_of([machine], name="late")

    tasks.machine_shared_free(job.pk)

    job.refresh_from_db()
    assert job.state == JobState.FAILED
    assert job.error == "lab-a is in late: /shared there holds the cluster's files. Delete late or take lab-a out of it first."
    assert fakes.calls == []


def test_the_agents_refusal_of_shared_clear_ends_the_job_in_its_words(operator, monkeypatch):
    machine = gpu_machine("lab-a", 11)
    FakeAgents({"lab-a": {"shared_clear_error": ("not_retryable", "/shared here is mounted from root@198.18.1.10:/shared: "
                                                 "its files are that machine's, not this one's")}}).install(monkeypatch)
    job = leftovers.machine_shared_free(machine=machine, user=operator)
    tasks.machine_shared_free(job.pk)
    job.refresh_from_db()
    assert job.state == JobState.FAILED and job.error.startswith("lab-a: /shared here is mounted from root@198.18.1.10")


# -- the machine's page ------------------------------------------------------------------------------


def test_the_machine_page_offers_both_when_no_cluster_holds_the_machine_and_the_post_starts_the_job(admin_client):
    machine = gpu_machine("lab-a", 11)
    html = admin_client.get(f"/machines/{machine.pk}/").content.decode()
    assert "Left by deleted clusters" in html
    assert f'formaction="/clusters/machines/{machine.pk}/free-images/"' in html
    assert f'formaction="/clusters/machines/{machine.pk}/free-shared/"' in html

    response = admin_client.post(f"/clusters/machines/{machine.pk}/free-shared/", follow=True)

    assert "Freeing /shared on lab-a" in response.content.decode()
    assert Job.objects.get().kind == leftovers.SHARED_KIND


def test_the_machine_page_greys_them_out_with_the_sentence_while_a_cluster_runs_there(admin_client):
    cluster = cluster_of([gpu_machine("lab-a", 11)])
    html = admin_client.get(f"/machines/{cluster.members.get().machine.pk}/").content.decode()
    assert disabled_button_why(html, "Free runtime images").startswith("lab-a runs gpu-room's runtime (running)")
    assert disabled_button_why(html, "Free /shared").startswith("lab-a is in gpu-room")
    refused = admin_client.post(f"/clusters/machines/{cluster.members.get().machine.pk}/free-images/", follow=True)
    assert "its image stays while the cluster uses it" in refused.content.decode()
    assert not Job.objects.exists() and Cluster.objects.get().state == ClusterState.RUNNING


def test_the_machine_pages_models_card_removes_a_models_files_from_this_machine(admin_client, client):
    from deployments.models import ModelHolding
    from tests.builders import ready_model

    machine = gpu_machine("lab-a", 11)
    model = ready_model("org/chat")
    ModelHolding.objects.create(model=model, machine=machine, bytes=10**9, path="/var/lib/fadenstack/models/org--chat/abc")

    html = admin_client.get(f"/machines/{machine.pk}/").content.decode()
    assert re.search(rf'formaction="/models/{model.pk}/remove/" name="machine" value="{machine.pk}"', html)
    client.force_login(UserFactory(username="vic", role=roles.VIEWER))
    assert "needs an Operator" in disabled_button_why(client.get(f"/machines/{machine.pk}/").content.decode(), "Remove")


# -- the API -----------------------------------------------------------------------------------------


def test_the_api_starts_the_job_and_refuses_with_the_pages_sentence(api_client):
    free = gpu_machine("lab-a", 11)
    started = api_client.post(f"/api/machines/{free.pk}/free-images/")
    assert started.status_code == 202 and started.json()["kind"] == leftovers.IMAGES_KIND

    held = cluster_of([gpu_machine("lab-b", 12)]).members.get().machine
    refused = api_client.post(f"/api/machines/{held.pk}/free-shared/")
    assert refused.status_code == 400
    assert refused.json()["message"] == ("lab-b is in gpu-room: /shared there holds the cluster's files. Delete "
                                         "gpu-room or take lab-b out of it first.")
    assert api_client.post("/api/machines/987654/free-shared/").status_code == 404


def test_a_viewer_is_refused_by_the_api_with_403(client):
    from rest_framework.test import APIClient

    viewer = APIClient()
    viewer.force_authenticate(UserFactory(username="vic", role=roles.VIEWER))
    response = viewer.post(f"/api/machines/{gpu_machine('lab-a', 11).pk}/free-images/")
    assert response.status_code == 403 and "needs an Operator" in response.json()["message"]
    assert not Job.objects.exists()
