"""/api/settings/hugging-face-token/: every role reads whether a token is set and where from; an
Administrator sets, replaces and removes it; the others get the role's 403 and change nothing; the
token is in no answer and in no audit row."""
import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from console import roles
from console.models import AuditEntry
from console.roles import ADMINISTRATOR, OPERATOR, VIEWER
from deployments.store import hub_token
from deployments.store.hub_token import hf_token
from tests.factories import NO_ROLE, UserFactory

pytestmark = pytest.mark.django_db

URL = "/api/settings/hugging-face-token/"
TOKEN = "hf_ApiToken0123456789abcdef"


@pytest.fixture(autouse=True)
def sealed_here(settings, tmp_path, monkeypatch):
    settings.FADEN_SECRETS_KEY_PATH = tmp_path / "secrets.key"
    monkeypatch.delenv(hub_token.ENV_VAR, raising=False)


def client_as(role) -> APIClient:
    client = APIClient()
    user = UserFactory(username=f"as-{role or 'nobody'}".lower(), role=role or NO_ROLE)
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


def test_set_replace_and_remove_answer_only_whether_a_token_is_set(api_client):
    answers = [api_client.get(URL), api_client.put(URL, {"token": TOKEN}, format="json")]
    after_set = hf_token()
    answers += [api_client.put(URL, {"token": f" {TOKEN}-2 "}, format="json")]
    after_replace = hf_token()
    answers += [api_client.get(URL), api_client.delete(URL), api_client.delete(URL)]

    assert [a.status_code for a in answers] == [200] * 6
    assert [a.json() for a in answers] == [
        {"set": False, "source": None}, {"set": True, "source": "settings"}, {"set": True, "source": "settings"},
        {"set": True, "source": "settings"}, {"set": False, "source": None}, {"set": False, "source": None}]
    assert (after_set, after_replace, hf_token()) == (TOKEN, f"{TOKEN}-2", None)
    assert not any(TOKEN in a.content.decode() for a in answers)


def test_the_audit_trail_records_each_change_without_the_token(api_client):
    api_client.put(URL, {"token": TOKEN}, format="json")
    api_client.put(URL, {"token": f"{TOKEN} with a space"}, format="json")
    api_client.delete(URL)

    rows = list(AuditEntry.objects.order_by("id").values_list("action", "outcome", "message"))
    assert ("settings.hf_token", "done", "The Hugging Face token was set.") in rows
    assert ("settings.hf_token", "done", "The Hugging Face token was removed.") in rows
    assert any(outcome == "refused" and "no spaces" in message for _, outcome, message in rows)
    assert TOKEN not in repr(list(AuditEntry.objects.values()))


def test_the_environments_token_is_named_as_the_source_and_stays_after_a_remove(api_client, monkeypatch):
    monkeypatch.setenv(hub_token.ENV_VAR, "hf_FromTheEnvironment")

    put = api_client.put(URL, {"token": TOKEN}, format="json")
    removed = api_client.delete(URL)

    assert put.json() == removed.json() == {"set": True, "source": "environment"}
    assert hf_token() == "hf_FromTheEnvironment"
    assert "hf_FromTheEnvironment" not in put.content.decode() + removed.content.decode()


@pytest.mark.parametrize(("body", "words"), [
    ({"token": "hf two"}, "no spaces or line breaks inside"),
    ({"token": "short"}, "8 to 1024 characters long"),
    ({"token": 12345678}, "must be text"),
    ({"token": ""}, "Enter the token."),
    ({}, "This field is required."),
])
def test_a_token_that_cannot_be_one_is_a_400_that_says_why(api_client, body, words):
    response = api_client.put(URL, body, format="json")

    assert response.status_code == 400
    assert response.json()["message"] == f"token: {words}" or words in response.json()["message"]
    assert hf_token() is None


@pytest.mark.parametrize("role", [None, VIEWER, OPERATOR, ADMINISTRATOR], ids=str)
def test_every_role_reads_whether_it_is_set_and_only_an_administrator_changes_it(role):
    hub_token.hf_token_set(token=TOKEN, by=None)
    client = client_as(role)

    read, put, delete = client.get(URL), client.put(URL, {"token": "hf_SomethingElse"}, format="json"), client.delete(URL)

    if role is ADMINISTRATOR:
        assert [read.status_code, put.status_code, delete.status_code] == [200, 200, 200]
        assert hf_token() is None
        return
    sentence = roles.NO_ROLE if role is None else f"Your role is {role}: changing the console's settings needs an Administrator."
    assert read.status_code == (403 if role is None else 200)
    assert (put.status_code, delete.status_code) == (403, 403)
    assert put.json() == delete.json() == {"message": sentence}
    assert hf_token() == TOKEN


def test_the_schema_describes_the_endpoint_and_its_refusals(api_client):
    schema = api_client.get("/api/schema/?format=json").json()
    operations = schema["paths"][URL]

    assert set(operations) == {"get", "put", "delete"}
    assert {"200", "403"} <= set(operations["put"]["responses"]) and "400" in operations["put"]["responses"]
    assert operations["delete"]["responses"]["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/HfTokenState"}
    assert schema["components"]["schemas"]["HfTokenState"]["required"] == ["set", "source"]
