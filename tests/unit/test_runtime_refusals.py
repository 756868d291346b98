"""A machine without a container runtime is refused before a start, not during it: the wizard's
machine step and Add machines mark it with the sentence and do not let it be ticked, and the
services and the API refuse it with the same sentence."""
import re
from html import unescape

import pytest
from django.core.exceptions import ValidationError

from clusters import services
from clusters.models import Cluster, RuntimeImage
from tests.builders import NETWORK, cluster_of, gpu_machine

pytestmark = pytest.mark.django_db

SENTENCE = "No container runtime on lab-x: install Docker or Podman"


@pytest.fixture
def build():
    return RuntimeImage.objects.create(name="NVIDIA x86_64 Runtime", version="2.1.0", digest="ab" * 32,
                                       size_bytes=1024, arch="x86_64", accelerator_vendor="nvidia", path="/images/a.img")


@pytest.fixture
def machines(build):
    """lab-a has Docker; lab-x has neither Docker nor Podman."""
    return gpu_machine("lab-a", 11), gpu_machine("lab-x", 12, no_runtime=True)


def checkbox(html: str, machine) -> str:
    return re.search(rf'<input type="checkbox" name="machines" value="{machine.pk}"[^>]*>', html).group(0)


def test_the_wizard_marks_a_machine_without_a_runtime_and_does_not_let_it_be_picked(admin_client, machines):
    ready, bare = machines

    html = unescape(admin_client.get("/clusters/new/?step=machines&name=gpu-room").content.decode())

    assert SENTENCE in html
    assert "disabled" in checkbox(html, bare)
    assert "disabled" not in checkbox(html, ready)


def test_the_wizard_s_can_be_picked_filter_leaves_it_out(admin_client, machines):
    html = admin_client.get("/clusters/new/?step=machines&name=gpu-room&state=available").content.decode()
    assert re.findall(r'aria-label="Pick ([\w-]+)"', html) == ["lab-a"]


def test_a_machine_without_a_runtime_picked_by_hand_blocks_next_with_the_sentence(admin_client, machines):
    ready, bare = machines

    html = unescape(admin_client.get(f"/clusters/new/?step=network&name=gpu-room&machines={ready.pk},{bare.pk}").content.decode())

    assert f"{SENTENCE}. Remove it from the selection." in html
    assert 'name="network"' not in html  # sent back to the machine step


def test_creating_a_cluster_with_it_anyway_is_refused_with_the_sentence(admin_client, machines):
    ready, bare = machines
    form = {"name": "gpu-room", "machines": f"{ready.pk},{bare.pk}", "head": str(ready.pk), "network": NETWORK}

    response = admin_client.post("/clusters/new/create/", form, follow=True)

    assert SENTENCE in unescape(response.content.decode())
    assert not Cluster.objects.exists()


def test_the_service_refuses_it_with_the_sentence(machines):
    ready, bare = machines

    with pytest.raises(ValidationError) as refused:
        services.cluster_create(name="gpu-room", machine_ids=[ready.pk, bare.pk], head_id=ready.pk, network=NETWORK)

    assert refused.value.message_dict == {"machines": [SENTENCE]}


def test_the_api_refuses_it_with_the_sentence(api_client, machines):
    ready, bare = machines

    response = api_client.post("/api/clusters/", {"name": "gpu-room", "machines": [ready.pk, bare.pk], "head": ready.pk,
                                                  "network": NETWORK}, format="json")

    assert response.status_code == 400
    assert response.json()["errors"] == {"machines": [SENTENCE]}


def test_add_machines_marks_it_and_does_not_let_it_be_ticked(admin_client, machines, build):
    ready, bare = machines
    cluster = cluster_of([ready], runtime=build)

    html = unescape(admin_client.get(f"/clusters/{cluster.pk}/add/").content.decode())

    assert SENTENCE in html
    assert "disabled" in checkbox(html, bare)


def test_adding_it_anyway_is_refused_with_the_sentence_and_nothing_joins(admin_client, machines, build):
    ready, bare = machines
    cluster = cluster_of([ready], runtime=build)

    response = admin_client.post(f"/clusters/{cluster.pk}/add/", {"machines": [str(bare.pk)]})

    assert response.status_code == 400
    assert SENTENCE in unescape(response.content.decode())
    assert list(cluster.members.values_list("machine__name", flat=True)) == ["lab-a"]


def test_the_api_s_join_candidates_and_add_machines_say_the_sentence(api_client, machines, build):
    ready, bare = machines
    cluster = cluster_of([ready], runtime=build)

    candidates = api_client.get(f"/api/clusters/{cluster.pk}/join-candidates/").json()
    added = api_client.post(f"/api/clusters/{cluster.pk}/machines/", {"machines": [bare.pk]}, format="json")

    [row] = [row for row in candidates["results"] if row["name"] == "lab-x"]
    assert (row["selectable"], row["refusal"]) == (False, SENTENCE)
    assert added.status_code == 400 and added.json()["errors"] == {"machines": [SENTENCE]}
