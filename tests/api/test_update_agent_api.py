"""POST /api/machines/<id>/update-agent/ and the agent fields of a machine: 202 with the job, 400 with
the sentence, 403 for a role below Operator, 404 for no such machine."""
import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from console import roles
from console.choices import AuditOutcome, JobState
from console.models import AuditEntry, Job
from machines import tasks
from machines.agent import agent_version
from machines.choices import MachineState
from tests.factories import JobFactory, MachineFactory, UserFactory

pytestmark = pytest.mark.django_db

SHIPPED = agent_version()


@pytest.fixture
def update_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(tasks.machine_update_agent, "delay", lambda job_id: calls.append(job_id))
    return calls


def client_of(role) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=UserFactory(role=role)).key}")
    return client


def test_a_machine_says_which_agent_the_console_ships_and_whether_its_own_is_older(api_client):
    old, current = MachineFactory(agent_version="0.0.1"), MachineFactory()

    body = {m["id"]: m for m in api_client.get("/api/machines/").json()["results"]}

    assert (body[old.pk]["agent_outdated"], body[old.pk]["agent_latest"]) == (True, SHIPPED)
    assert (body[current.pk]["agent_outdated"], body[current.pk]["agent_version"]) == (False, SHIPPED)


def test_update_agent_is_a_202_with_the_job_sent_after_commit(update_calls, django_capture_on_commit_callbacks):
    machine = MachineFactory(name="lab-a", agent_version="0.0.1")

    with django_capture_on_commit_callbacks(execute=True):
        response = client_of(roles.OPERATOR).post(f"/api/machines/{machine.pk}/update-agent/")

    assert response.status_code == 202
    job = response.json()
    assert (job["kind"], job["title"], job["state"]) == ("machine.update_agent", "Update agent on lab-a", JobState.QUEUED)
    assert update_calls == [job["id"]]
    assert AuditEntry.objects.get(action="machine-update-agent").outcome == AuditOutcome.DONE


@pytest.mark.parametrize(("state", "words"), [
    (MachineState.OFFLINE, "lab-a is offline: its agent can be updated once it beats again."),
    (MachineState.ENROLLING, "lab-a is being enrolled, which installs the current agent."),
])
def test_a_machine_that_cannot_take_it_now_is_a_400_that_says_why(api_client, update_calls, state, words):
    machine = MachineFactory(name="lab-a", state=state, agent_version="0.0.1")

    response = api_client.post(f"/api/machines/{machine.pk}/update-agent/")

    assert (response.status_code, response.json()["message"]) == (400, words)
    assert not Job.objects.exists()


def test_a_machine_with_a_job_running_is_a_400(api_client, update_calls):
    machine = MachineFactory(name="lab-a", agent_version="0.0.1")
    JobFactory(target_id=machine.pk, state=JobState.RUNNING)

    response = api_client.post(f"/api/machines/{machine.pk}/update-agent/")

    assert (response.status_code, response.json()["message"]) == (
        400, "A job is already running on lab-a; wait for it to finish.")


def test_a_viewer_gets_a_403_that_names_the_role_it_needs(update_calls):
    machine = MachineFactory(agent_version="0.0.1")

    response = client_of(roles.VIEWER).post(f"/api/machines/{machine.pk}/update-agent/")

    assert response.status_code == 403
    assert response.json() == {"message": "Your role is Viewer: updating a machine's agent needs an Operator."}
    assert update_calls == []
    assert AuditEntry.objects.get(action="machine-update-agent").outcome == AuditOutcome.REFUSED


def test_no_such_machine_is_a_404(api_client, update_calls):
    assert api_client.post("/api/machines/987654/update-agent/").status_code == 404


def test_the_schema_describes_update_agent_and_the_agent_fields(api_client):
    schema = api_client.get("/api/schema/?format=json").json()
    operation = schema["paths"]["/api/machines/{id}/update-agent/"]["post"]
    assert {"202", "400", "403", "404"} <= set(operation["responses"])
    fields = schema["components"]["schemas"]["Machine"]["properties"]
    assert fields["agent_outdated"]["readOnly"] and fields["agent_latest"]["readOnly"]
