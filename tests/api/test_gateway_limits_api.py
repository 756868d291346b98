"""REST for a gateway key's limits and usage: set at creation, changed by PATCH (null: no limit, left out:
unchanged), refused in words (negative, zero, not a number, too large), the Operator's; usage by the hour."""
from datetime import UTC, datetime, timedelta

import pytest
from rest_framework.test import APIClient

from console import roles
from deployments import gateway_keys
from deployments.models import GatewayKey, KeyUsage
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db

KEYS = "/api/gateway/keys/"


def client_for(role) -> APIClient:
    client = APIClient()
    client.force_authenticate(UserFactory(role=role))
    return client


def test_a_key_is_created_with_its_limits_and_lists_them():
    operator = client_for(roles.OPERATOR)

    created = operator.post(KEYS, {"name": "batch", "requests_per_minute": 60, "tokens_per_minute": "100000"}, format="json")
    plain = operator.post(KEYS, {"name": "chat"}, format="json")

    assert created.status_code == 201, created.json()
    assert created.json()["requests_per_minute"] == 60 and created.json()["tokens_per_minute"] == 100_000
    assert plain.json()["requests_per_minute"] is None and plain.json()["tokens_per_minute"] is None
    listed = {k["name"]: (k["requests_per_minute"], k["tokens_per_minute"]) for k in client_for(roles.VIEWER).get(KEYS).json()["results"]}
    assert listed == {"batch": (60, 100_000), "chat": (None, None)}


def test_patch_sets_the_limits_given_and_leaves_the_others():
    key, _ = gateway_keys.gateway_key_create(name="app", requests_per_minute=10, tokens_per_minute=5000)
    operator = client_for(roles.OPERATOR)

    tokens_only = operator.patch(f"{KEYS}{key.pk}/", {"tokens_per_minute": 800}, format="json")
    lifted = operator.patch(f"{KEYS}{key.pk}/", {"requests_per_minute": None}, format="json")

    assert tokens_only.status_code == 200 and tokens_only.json()["requests_per_minute"] == 10
    assert tokens_only.json()["tokens_per_minute"] == 800
    assert lifted.status_code == 200 and lifted.json()["requests_per_minute"] is None
    key.refresh_from_db()
    assert (key.requests_per_minute, key.tokens_per_minute) == (None, 800)


@pytest.mark.parametrize("body, words", [
    ({"requests_per_minute": -5}, "requests_per_minute: Give at least 1 request a minute, or leave it empty for no limit: "
                                  "-5 would refuse every request (revoke the key to stop it)."),
    ({"requests_per_minute": 0}, "0 would refuse every request (revoke the key to stop it)."),
    ({"tokens_per_minute": "0"}, "tokens_per_minute: Give at least 1 token a minute"),
    ({"requests_per_minute": "lots"}, "requests_per_minute: Give the requests a minute as a whole number, such as 60, or "
                                      "leave it empty for no limit; 'lots' is not one."),
    ({"tokens_per_minute": 1.5}, "tokens_per_minute: Give the tokens (prompt and completion) a minute as a whole number"),
    ({"requests_per_minute": True}, "'True' is not one."),
    ({"requests_per_minute": "١٢"}, "'١٢' is not one."),
    ({"requests_per_minute": 10_000_001}, "requests_per_minute: At most 10,000,000 requests a minute; leave it empty for no limit."),
])
def test_bad_limits_are_refused_in_words_and_nothing_changes(body, words):
    key, _ = gateway_keys.gateway_key_create(name="app", requests_per_minute=10)
    operator = client_for(roles.OPERATOR)

    changed = operator.patch(f"{KEYS}{key.pk}/", body, format="json")
    created = operator.post(KEYS, {"name": "other", **body}, format="json")

    assert changed.status_code == 400 and words in changed.json()["message"], changed.json()
    assert created.status_code == 400 and words in created.json()["message"], created.json()
    assert GatewayKey.objects.get().requests_per_minute == 10 and GatewayKey.objects.count() == 1


def test_a_viewer_reads_limits_and_usage_but_may_not_change_them():
    key, _ = gateway_keys.gateway_key_create(name="app", requests_per_minute=10)
    viewer = client_for(roles.VIEWER)

    answer = viewer.patch(f"{KEYS}{key.pk}/", {"requests_per_minute": 1000}, format="json")

    assert answer.status_code == 403 and answer.json()["message"] == (
        "Your role is Viewer: changing a gateway key's limits needs an Operator.")
    assert GatewayKey.objects.get().requests_per_minute == 10
    assert viewer.get(f"{KEYS}{key.pk}/usage/").status_code == 200


def test_a_revoked_keys_limits_are_not_changed():
    key, _ = gateway_keys.gateway_key_create(name="gone")
    gateway_keys.gateway_key_revoke(key=key)

    answer = client_for(roles.OPERATOR).patch(f"{KEYS}{key.pk}/", {"requests_per_minute": 5}, format="json")

    assert answer.status_code == 400 and "was revoked: its limits no longer matter" in answer.json()["message"]


def test_put_is_not_an_update_of_a_key():
    key, _ = gateway_keys.gateway_key_create(name="app")
    assert client_for(roles.OPERATOR).put(f"{KEYS}{key.pk}/", {"name": "x"}, format="json").status_code == 405


def test_usage_answers_every_hour_asked_oldest_first_with_totals():
    key, _ = gateway_keys.gateway_key_create(name="app")
    this_hour = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    KeyUsage.objects.create(key=key, hour=this_hour, requests=5, errors=1, refused=2, prompt_tokens=50, completion_tokens=9)
    KeyUsage.objects.create(key=key, hour=this_hour - timedelta(hours=3), requests=1)
    KeyUsage.objects.create(key=key, hour=this_hour - timedelta(hours=30), requests=100)

    day = client_for(roles.VIEWER).get(f"{KEYS}{key.pk}/usage/").json()
    four = client_for(roles.VIEWER).get(f"{KEYS}{key.pk}/usage/?hours=4").json()

    assert len(day["hours"]) == 24 and day["total"] == {"requests": 6, "errors": 1, "refused": 2, "prompt_tokens": 50,
                                                        "completion_tokens": 9}
    assert [h["requests"] for h in four["hours"]] == [1, 0, 0, 5]
    assert four["hours"][-1] == {"hour": this_hour.isoformat().replace("+00:00", "Z"), "requests": 5, "errors": 1,
                                 "refused": 2, "prompt_tokens": 50, "completion_tokens": 9}
    assert four["key"] == key.pk and four["start"].startswith((this_hour - timedelta(hours=3)).strftime("%Y-%m-%dT%H"))


@pytest.mark.parametrize("hours", ["0", "721", "x", "-1"])
def test_usage_refuses_hours_out_of_range_in_words(hours):
    key, _ = gateway_keys.gateway_key_create(name="app")
    answer = client_for(roles.VIEWER).get(f"{KEYS}{key.pk}/usage/?hours={hours}")
    assert answer.status_code == 400 and "hours: Give a whole number from 1 to 720" in answer.json()["message"]


def test_limits_and_usage_are_in_the_api_schema():
    schema = client_for(roles.VIEWER).get("/api/schema/?format=json").json()

    assert "patch" in schema["paths"]["/api/gateway/keys/{id}/"]
    assert "get" in schema["paths"]["/api/gateway/keys/{id}/usage/"]
    limits = schema["components"]["schemas"]["PatchedGatewayKeyLimits"]["properties"]
    assert limits["requests_per_minute"]["type"] == "integer" and limits["requests_per_minute"]["nullable"] is True
