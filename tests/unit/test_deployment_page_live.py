"""What moves on a deployment's page and on the Gateway page: the traffic cards, polled from Redis (with
figures, and when Redis gives none), and the bars of copies getting the model's files, pushed as the files
travel."""

import pytest
from django.test import Client
from django.utils import timezone

from clusters.choices import ClusterState
from clusters.models import ClusterMember, Transfer
from console import live, roles
from deployments import gateway_keys
from deployments.choices import CopyState
from deployments.gateway import traffic
from deployments.models import Copy, ModelFile
from deployments.store import disk
from deployments.store.services import model_copy
from tests.builders import cluster_of, deployment_of, gpu_machine, ready_model
from tests.factories import UserFactory
from tests.fakes import FakeAgents

from tests.unit.test_gateway_page import gateway_redis  # noqa: F401 (a fixture: figures under a prefix of the test's own)

pytestmark = pytest.mark.django_db

GiB = 2**30


def signed_in(role) -> Client:
    client = Client()
    client.force_login(UserFactory(role=role))
    return client


@pytest.fixture
def no_redis(settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there: the figures cannot be read


@pytest.fixture
def llama():
    cluster = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)])
    deployment = deployment_of(cluster, name="llama")
    Copy.objects.create(deployment=deployment, number=1, state=CopyState.SERVING, address="198.18.1.11", port=8100,
                        serving_since=timezone.now())
    return deployment


def requests_counted(gateway_redis, deployment, *, ok: int, failed: int) -> None:
    client, prefix = gateway_redis
    counts = traffic.Counts()
    for _ in range(ok):
        counts.record(deployment.pk, seconds=0.004, error=False)
    for _ in range(failed):
        counts.record(deployment.pk, seconds=0.9, error=True)
    traffic.counts_flush(client, prefix, counts)


# -- the deployment's Traffic card ------------------------------------------------------------------


def test_the_deployment_page_shows_its_traffic_in_a_card_that_polls_its_fragment(llama, gateway_redis):
    requests_counted(gateway_redis, llama, ok=40, failed=1)
    html = signed_in(roles.VIEWER).get(f"/deployments/{llama.pk}/").content.decode()
    card = html.split('id="deployment-traffic"')[1].split("</section>")[0]
    assert f'hx-get="/deployments/{llama.pk}/traffic/" hx-trigger="every 5s" hx-swap="outerHTML" data-poll' in card
    assert "8.2" in card, "41 requests in 5 minutes: 8.2 a minute"
    assert 'class="text-red">1 <span class="traffic__share">2.4%</span>' in card
    assert "<title>41 requests this minute</title>" in card
    # The card is outside the part the websocket pushes: a push never reads Redis.
    assert "deployment-traffic" not in "".join(live.render_topic(f"deployment:{llama.pk}", "", roles.VIEWER))


def test_the_traffic_fragment_is_the_card_alone_with_the_latest_figures(llama, gateway_redis):
    client = signed_in(roles.VIEWER)
    before = client.get(f"/deployments/{llama.pk}/traffic/").content.decode()
    assert before.lstrip().startswith('<section class="card" id="deployment-traffic"') and "traffic--idle" in before
    requests_counted(gateway_redis, llama, ok=5, failed=0)

    after = client.get(f"/deployments/{llama.pk}/traffic/").content.decode()
    assert "traffic--idle" not in after and "<title>5 requests this minute</title>" in after
    assert "csrfmiddlewaretoken" not in after and "<html" not in after


def test_the_traffic_fragment_says_so_when_redis_gives_no_figures(llama, no_redis):
    html = signed_in(roles.VIEWER).get(f"/deployments/{llama.pk}/traffic/").content.decode()
    assert "No figures: the console could not read them from Redis." in html
    page = signed_in(roles.VIEWER).get(f"/deployments/{llama.pk}/")
    assert page.status_code == 200 and "No figures: the console could not read them from Redis." in page.content.decode()


def test_the_traffic_fragment_of_a_deleted_deployment_stops_the_polling(llama):
    pk = llama.pk
    llama.delete()
    response = signed_in(roles.VIEWER).get(f"/deployments/{pk}/traffic/")
    assert response.status_code == 286 and response.content == b""  # htmx: stop polling, swap in nothing


# -- the Gateway page's figures -----------------------------------------------------------------------


def test_the_gateway_page_polls_its_figures_and_keeps_the_keys_outside(llama, gateway_redis):
    client = signed_in(roles.OPERATOR)
    gateway_keys.gateway_key_create(name="support-bot")
    page = client.get("/gateway/?page=1").content.decode()
    assert "{#" not in page and "{%" not in page
    card = page.split('id="gateway-traffic"')[1].split(">")[0]
    assert 'hx-get="/gateway/traffic/?page=1" hx-trigger="every 5s" hx-swap="outerHTML" data-poll' in card
    requests_counted(gateway_redis, llama, ok=10, failed=0)

    html = client.get("/gateway/traffic/?page=1").content.decode()
    assert html.lstrip().startswith('<section class="card" id="gateway-traffic"')
    assert '<div class="grid grid--4" id="gateway-stats" hx-swap-oob="true">' in html
    assert '<section class="card" id="gateway-rotation" hx-swap-oob="true">' in html
    assert "<title>10 requests this minute</title>" in html and '<span class="stat__value">2</span>' in html
    assert "support-bot" not in html and "csrfmiddlewaretoken" not in html and "gateway-keys" not in html


def test_the_gateway_fragment_says_so_when_redis_gives_no_figures(llama, no_redis):
    html = signed_in(roles.VIEWER).get("/gateway/traffic/").content.decode()
    assert "The console could not read the figures from Redis" in html and "Redis does not answer" in html


# -- bars of copies getting the model's files ----------------------------------------------------------


def test_a_copy_getting_the_model_shows_a_bar_per_machine_of_its_slots(llama):
    cluster, model = llama.cluster, llama.model
    members = {m.machine.name: m for m in ClusterMember.objects.filter(cluster=cluster).select_related("machine")}
    a, b = members["gpu-a"], members["gpu-b"]
    Copy.objects.create(deployment=llama, number=2, state=CopyState.COPYING, state_reason="Its machine gets the model's files.",
                        machine=a.machine, slots=[{"machine": a.machine_id, "gpus": [0, 1, 2, 3, 4, 5, 6, 7], "quarters": 4, "port": 8101},
                                                  {"machine": b.machine_id, "gpus": [0, 1, 2, 3, 4, 5, 6, 7], "quarters": 4, "port": 8100}])
    Transfer.objects.create(member=a, digest="1" * 64, what=str(model), source="the server", bytes_total=12 * GiB,
                            bytes_done=3 * GiB, rate=200 * 2**20)
    Transfer.objects.create(member=a, digest="2" * 64, what=str(model), source="the server", bytes_total=4 * GiB,
                            bytes_done=1 * GiB, rate=100 * 2**20)
    Transfer.objects.create(member=a, digest="9" * 64, what="the runtime image", source="the server", bytes_total=GiB)

    html = signed_in(roles.VIEWER).get(f"/deployments/{llama.pk}/").content.decode().replace("\xa0", " ")
    row = html.split('id="copy-2"')[1].split("</tr>")[0]
    assert row.count('role="progressbar"') == 1, "one bar for the model on gpu-a (its runtime image is not this page's)"
    assert 'aria-valuenow="25"' in row and "4.0 GB of 16.0 GB" in row and "300.0 MB/s · 41 s left" in row
    assert "from the server" in row and "gpu-b waits for its turn to get the files." in row
    assert '<div class="bar__fill" data-percent="25">' in row
    # The same bars come with the websocket's push of the live part.
    main = live.render_topic(f"deployment:{llama.pk}", "", roles.VIEWER)[1]
    assert 'aria-valuenow="25"' in main.split('id="copy-2"')[1]
    # The cluster's page draws its bar with the same partial.
    cluster_html = signed_in(roles.VIEWER).get(f"/clusters/{cluster.pk}/").content.decode()
    assert 'aria-label="gpu-a org/chat"' in cluster_html and 'aria-valuenow="25"' in cluster_html


@pytest.mark.django_db(transaction=True)  # the bars are written from the board's own thread
def test_a_model_s_files_travelling_push_the_pages_of_its_deployments_on_that_cluster(monkeypatch):
    cluster = cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)], state=ClusterState.STOPPED)
    model = ready_model("org/chat")
    ModelFile.objects.create(model=model, path="model.safetensors", size=40 * 2**20, sha256="2" * 64,
                             chunk_size=disk.CHUNK_SIZE, chunk_hashes=["b" * 64] * 5)
    here = deployment_of(cluster, model, name="chat")
    elsewhere = deployment_of(cluster_of([gpu_machine("lab-c", 13)], name="other-room"), model, name="chat-2")
    other_model = deployment_of(cluster, ready_model("org/other"), name="other")
    FakeAgents().install(monkeypatch)
    pushed = []
    monkeypatch.setattr(live, "push", lambda topic, part="": pushed.append(topic))

    model_copy(model, cluster, user=UserFactory(role=roles.OPERATOR))

    assert f"deployment:{here.pk}" in pushed and f"cluster:{cluster.pk}" in pushed
    assert f"deployment:{elsewhere.pk}" not in pushed and f"deployment:{other_model.pk}" not in pushed
