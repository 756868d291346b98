"""GET /api/audit/: the audit trail as JSON, read-only, for Administrators."""
import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from console.choices import AuditOutcome
from console.models import AuditEntry
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db


def test_an_administrator_reads_the_entries_newest_first_and_filters_them(api_client):
    AuditEntry.objects.create(action="clusters:stop", username="ada", outcome=AuditOutcome.REFUSED, message="It is busy.",
                              address="192.0.2.1", method="POST", target="/clusters/3/stop/", status=302)
    AuditEntry.objects.create(action="login.failed", username="mallory", outcome=AuditOutcome.REFUSED)

    everything = api_client.get("/api/audit/").json()
    refused_for_ada = api_client.get("/api/audit/?outcome=refused&user=ad&action=clusters:").json()

    assert [e["action"] for e in everything["results"]][:2] == ["login.failed", "clusters:stop"]
    [entry] = refused_for_ada["results"]
    assert {k: entry[k] for k in ("username", "action", "method", "target", "address", "outcome", "status", "message")} == {
        "username": "ada", "action": "clusters:stop", "method": "POST", "target": "/clusters/3/stop/",
        "address": "192.0.2.1", "outcome": "refused", "status": 302, "message": "It is busy."}


def test_it_is_read_only(api_client):
    entry = AuditEntry.objects.create(action="login", outcome=AuditOutcome.DONE)

    assert api_client.post("/api/audit/", {}, format="json").status_code == 405
    assert api_client.delete(f"/api/audit/{entry.pk}/").status_code == 405
    assert AuditEntry.objects.filter(pk=entry.pk).exists()


def test_other_users_are_refused_with_a_message():
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=UserFactory(username='ada', is_superuser=False)).key}")

    response = client.get("/api/audit/")

    assert response.status_code == 403
    assert response.json()["message"] == "Only Administrators may read the audit trail."


def test_anonymous_clients_are_refused(anonymous_api_client):
    assert anonymous_api_client.get("/api/audit/").status_code == 401
