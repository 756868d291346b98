"""REST for the gateway's keys: the secret in the create's answer only, hashed in the database, revoked
keys kept and marked, roles, refusals in words."""
import hashlib

import pytest
from rest_framework.test import APIClient

from console import roles
from console.models import AuditEntry
from deployments.models import GatewayKey
from tests.builders import cluster_of, deployment_of, gpu_machine, ready_model
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

KEYS = "/api/gateway/keys/"


def client_for(role) -> APIClient:
    client = APIClient()
    client.force_authenticate(UserFactory(role=role))
    return client


@pytest.fixture
def deployments():
    cluster = cluster_of([gpu_machine("gpu-a", 11)])
    return [deployment_of(cluster, name="llama"), deployment_of(cluster, ready_model("org/qwen"), name="qwen")]


def test_a_created_key_answers_its_secret_once_and_the_database_holds_only_its_hash(deployments):
    operator = client_for(roles.OPERATOR)

    created = operator.post(KEYS, {"name": "chat app", "deployments": ["qwen"]}, format="json")

    assert created.status_code == 201, created.json()
    body = created.json()
    secret = body["secret"]
    assert secret.startswith("fs-") and len(secret) == 46 and body["prefix"] == secret[:8]
    assert body["name"] == "chat app" and body["deployments"] == ["qwen"] and body["revoked_at"] is None
    assert body["created_by"] == operator.handler._force_user.username
    key = GatewayKey.objects.get(pk=body["id"])
    assert key.key_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in str(GatewayKey.objects.filter(pk=key.pk).values().get())
    assert "secret" not in operator.get(KEYS).json()["results"][0]
    assert secret not in operator.get(KEYS).content.decode() + operator.get(f"{KEYS}{key.pk}/").content.decode()
    entry = AuditEntry.objects.get(action="gateway-key-list")
    assert entry.outcome == "done" and secret not in entry.message


def test_every_role_lists_keys_newest_first_with_what_they_may_use():
    client_for(roles.OPERATOR).post(KEYS, {"name": "first"}, format="json")
    client_for(roles.OPERATOR).post(KEYS, {"name": "second", "deployments": []}, format="json")

    listed = client_for(roles.VIEWER).get(KEYS).json()

    assert [k["name"] for k in listed["results"]] == ["second", "first"] and listed["count"] == 2
    assert all(k["deployments"] == [] for k in listed["results"])


def test_a_revoked_key_stays_listed_with_when_and_revoking_again_changes_nothing():
    operator = client_for(roles.OPERATOR)
    pk = operator.post(KEYS, {"name": "leaked"}, format="json").json()["id"]

    assert operator.delete(f"{KEYS}{pk}/").status_code == 204
    revoked_at = GatewayKey.objects.get(pk=pk).revoked_at
    assert operator.delete(f"{KEYS}{pk}/").status_code == 204

    assert revoked_at is not None and GatewayKey.objects.get(pk=pk).revoked_at == revoked_at
    assert operator.get(f"{KEYS}{pk}/").json()["revoked_at"] is not None


def test_a_viewer_reads_keys_but_may_not_create_or_revoke_them():
    pk = client_for(roles.OPERATOR).post(KEYS, {"name": "ops"}, format="json").json()["id"]
    viewer = client_for(roles.VIEWER)

    created = viewer.post(KEYS, {"name": "mine"}, format="json")
    revoked = viewer.delete(f"{KEYS}{pk}/")

    assert created.status_code == 403 and created.json()["message"] == "Your role is Viewer: creating a gateway key needs an Operator."
    assert revoked.status_code == 403 and "revoking a gateway key needs an Operator" in revoked.json()["message"]
    assert GatewayKey.objects.count() == 1 and GatewayKey.objects.get().revoked_at is None
    assert viewer.get(KEYS).status_code == 200


@pytest.mark.parametrize("body, words", [
    ({}, "name: This field is required."),
    ({"name": "  "}, "name: This field may not be blank."),
    ({"name": 7}, "name: Give a string."),
    ({"name": "x" * 101}, "name: Ensure this field has no more than 100 characters."),
    ({"name": "tab\there"}, "printable characters"),
    ({"name": "ok", "deployments": ["llama", "nope"]}, "No deployment is named 'nope'."),
    ({"name": "ok", "deployments": "llama"}, "deployments: Expected a list of items"),
])
def test_bad_input_is_refused_in_words_and_no_key_is_made(deployments, body, words):
    answer = client_for(roles.OPERATOR).post(KEYS, body, format="json")

    assert answer.status_code == 400 and words in answer.json()["message"], answer.json()
    assert not GatewayKey.objects.exists()


def test_an_unknown_key_is_a_404():
    assert client_for(roles.OPERATOR).delete(f"{KEYS}987654/").status_code == 404


def test_the_keys_are_in_the_api_schema():
    schema = client_for(roles.VIEWER).get("/api/schema/?format=json").json()

    assert {"get", "post"} <= set(schema["paths"]["/api/gateway/keys/"])
    assert "delete" in schema["paths"]["/api/gateway/keys/{id}/"]
