"""The Gateway page: its URL, keys and traffic; a key's secret shown once, at its creation, and nowhere
else (not in a message, not in the audit trail, not cached); revoke behind a confirmation; greyed out
for a Viewer with the reason."""
import time
import uuid
from html import unescape

import pytest
from django.test import Client
from django.utils import timezone

from console import roles
from console.models import AuditEntry
from deployments import gateway_keys
from deployments.choices import CopyState
from deployments.gateway import traffic
from deployments.models import Copy, GatewayKey
from tests.builders import cluster_of, deployment_of, gpu_machine, ready_model
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def signed_in(role) -> Client:
    client = Client()
    client.force_login(UserFactory(role=role))
    return client


@pytest.fixture
def gateway_redis(settings):
    """Figures under a prefix of this test's own."""
    settings.FADEN_GATEWAY_REDIS_PREFIX = prefix = f"test-gateway-page-{uuid.uuid4().hex[:8]}"
    client = traffic.redis_client(settings.REDIS_URL)
    yield client, prefix
    names = list(client.scan_iter(f"{prefix}:*"))
    if names:
        client.delete(*names)


@pytest.fixture
def llama():
    cluster = cluster_of([gpu_machine("gpu-a", 11)])
    deployment = deployment_of(cluster, name="llama")
    Copy.objects.create(deployment=deployment, number=1, state=CopyState.SERVING, address="198.18.1.11", port=8100,
                        serving_since=timezone.now())
    Copy.objects.create(deployment=deployment, number=2, state=CopyState.STARTING, address="198.18.1.11", port=8101)
    deployment_of(cluster, ready_model("org/qwen"), name="qwen")
    return deployment


def test_the_page_shows_the_url_the_keys_and_each_deployments_traffic(llama, gateway_redis, settings):
    client_redis, prefix = gateway_redis
    counts = traffic.Counts()
    for seconds, error in [(0.004, False)] * 40 + [(0.9, True)]:
        counts.record(llama.pk, seconds=seconds, error=error)
    traffic.counts_flush(client_redis, prefix, counts)
    traffic.process_alive(client_redis, prefix, "host:1", {"copies": 1, "out_of_rotation": []})
    gateway_keys.gateway_key_create(name="support-bot", deployments=["llama"])

    html = unescape(signed_in(roles.VIEWER).get("/gateway/", HTTP_HOST="console.example:8000").content.decode())

    assert f"http://console.example:{settings.FADEN_GATEWAY_PORT}/v1" in html
    assert "support-bot" in html and "fs-" in html and "every model" not in html.split("gateway-keys")[1].split("</table>")[0]
    assert "1 of 2 copies serving" in html and "No copies" in html
    assert "8.2" in html, "41 requests in 5 minutes: 8.2 a minute"
    assert '<span class="stat__value">1<span class="stat__unit">up</span>' in html


def test_the_gateway_url_is_the_setting_when_given(settings):
    settings.FADEN_GATEWAY_URL = "https://llm.example.com"
    html = signed_in(roles.VIEWER).get("/gateway/").content.decode()
    assert "https://llm.example.com/v1" in html


def test_creating_a_key_shows_its_secret_once_and_keeps_it_out_of_messages_audit_and_caches(llama):
    operator = signed_in(roles.OPERATOR)

    created = operator.post("/gateway/keys/", {"name": "support-bot", "deployments": ["llama"]})

    assert created.status_code == 201 and created["Cache-Control"] == "no-store"
    key = GatewayKey.objects.get()
    html = created.content.decode()
    secret = html.split('id="gateway-secret">')[1].split("<")[0]
    assert secret.startswith(key.prefix) and len(secret) == 46 and key.deployments == ["llama"]
    assert "Copy it now" in html and f"Bearer {secret}" in html, "a curl example with the key itself"
    entry = AuditEntry.objects.get(action="gateway:key-create")
    assert entry.outcome == "done" and key.prefix in entry.message and secret not in entry.message
    assert secret not in operator.get("/gateway/").content.decode(), "shown once"


def test_a_refused_key_is_said_in_words_and_the_form_keeps_what_was_typed(llama):
    answer = signed_in(roles.OPERATOR).post("/gateway/keys/", {"name": "bot", "deployments": ["nope"]})

    assert answer.status_code == 400 and "No deployment is named &#x27;nope&#x27;." in answer.content.decode()
    assert 'value="bot"' in answer.content.decode() and not GatewayKey.objects.exists()


def test_revoke_is_behind_a_confirmation_and_refuses_the_key(llama):
    key, _ = gateway_keys.gateway_key_create(name="leaked")
    operator = signed_in(roles.OPERATOR)
    html = operator.get("/gateway/").content.decode()
    assert f'data-dialog-open="revoke-{key.pk}"' in html and f'action="/gateway/keys/{key.pk}/revoke/"' in html

    answer = operator.post(f"/gateway/keys/{key.pk}/revoke/", follow=True)

    assert "Revoked the key leaked" in answer.content.decode()
    assert GatewayKey.objects.get().revoked_at is not None
    assert "1 revoked key" in answer.content.decode()


def test_a_viewer_sees_the_buttons_greyed_out_with_the_reason_and_cannot_post(llama):
    key, _ = gateway_keys.gateway_key_create(name="ops")
    viewer = signed_in(roles.VIEWER)

    html = viewer.get("/gateway/").content.decode()

    assert "Your role is Viewer: creating a gateway key needs an Operator." in html
    assert "Your role is Viewer: revoking a gateway key needs an Operator." in html
    assert viewer.post("/gateway/keys/", {"name": "mine"}).status_code == 403
    assert viewer.post(f"/gateway/keys/{key.pk}/revoke/").status_code == 403
    assert GatewayKey.objects.count() == 1 and GatewayKey.objects.get().revoked_at is None


def test_the_page_says_so_when_redis_gives_no_figures(llama, settings):
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens there

    started = time.monotonic()
    html = signed_in(roles.VIEWER).get("/gateway/").content.decode()

    assert "could not read the figures from Redis" in html and "Redis does not answer" in html
    assert time.monotonic() - started < 5


def test_the_traffic_partial_reads_p50_and_p99_from_the_histogram():
    figures = traffic.Traffic()
    counts = traffic.Counts()
    for ms in [2] * 98 + [400, 900]:
        counts.record(1, seconds=ms / 1000, error=False)
    for bucket, count in counts.deployments[1].buckets.items():
        figures.buckets[bucket] += count
    assert 1 < figures.p50_ms <= 2 and 300 < figures.p99_ms <= 500
    assert traffic.percentile([0] * len(figures.buckets), 0.5) is None
