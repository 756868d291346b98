"""/agent/heartbeat/: machines say they are alive with their own token, no login, no CSRF token."""
import hashlib
import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from machines.choices import EventKind, MachineState
from machines.models import Machine
from tests.factories import MachineFactory

pytestmark = pytest.mark.django_db

URL = "/agent/heartbeat/"


@pytest.fixture
def agent():
    """What a machine's agent uses: a plain client, no session, CSRF checks on as in production."""
    return Client(enforce_csrf_checks=True)


@pytest.fixture
def token():
    return "the-token-this-machine-was-given-at-enrolment"


@pytest.fixture
def machine(token):
    return MachineFactory(
        heartbeat_token_hash=hashlib.sha256(token.encode()).hexdigest(),
        last_seen=timezone.now() - timedelta(seconds=25),
    )


def post(agent, token=None, body=None, scheme="Bearer"):
    headers = {"Authorization": f"{scheme} {token}"} if token is not None else {}
    return agent.post(URL, json.dumps(body or {"agent_version": "0.1.0"}), content_type="application/json", headers=headers)


def test_a_heartbeat_without_a_token_is_a_401_in_json(agent, machine):
    response = post(agent)
    assert response.status_code == 401
    assert "Authorization: Bearer" in response.json()["error"]


def test_a_heartbeat_with_a_token_no_machine_holds_is_a_401_in_json(agent, machine):
    response = post(agent, "someone-elses-token")
    assert response.status_code == 401
    assert "enrol the machine again" in response.json()["error"]
    machine.refresh_from_db()
    assert machine.last_seen < timezone.now() - timedelta(seconds=20)


def test_a_heartbeat_with_another_scheme_is_a_401(agent, machine, token):
    assert post(agent, token, scheme="Token").status_code == 401


def test_a_heartbeat_with_the_machines_token_is_a_200_without_a_login(agent, machine, token):
    response = post(agent, token)

    assert response.status_code == 200
    assert response.json() == {"ok": True, "machine": machine.name, "state": MachineState.HEALTHY}
    machine.refresh_from_db()
    assert machine.last_seen > timezone.now() - timedelta(seconds=5)


def test_a_heartbeat_brings_an_offline_machine_back(agent, machine, token):
    Machine.objects.filter(pk=machine.pk).update(state=MachineState.OFFLINE)

    assert post(agent, token).json()["state"] == MachineState.HEALTHY
    assert machine.events.filter(kind=EventKind.RECONNECTED).exists()


def test_a_heartbeat_whose_body_is_not_json_is_a_400(agent, machine, token):
    response = agent.post(URL, "not json", content_type="application/json", headers={"Authorization": f"Bearer {token}"})
    assert response.status_code == 400
    assert response.json()["error"].startswith("The body is not JSON: Expecting value")


def test_a_heartbeat_is_post_only(agent, machine, token):
    assert agent.get(URL, headers={"Authorization": f"Bearer {token}"}).status_code == 405
