"""Update agent: who may, on which machines, the job it starts, what that job does on the machine
(install the console's build, restart the heartbeat alone, check), and how the list and the page show it.

The job runs against ``FakeMachineShell``: the SSH session of the enrolment's install code, answered
as a machine would. Versions are relative to the one this console ships, whatever it is."""
from html import unescape

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.urls import reverse

from console import live, roles
from console.choices import AuditOutcome, JobState, StepState
from console.models import AuditEntry, Job
from machines import actions, services, tasks
from machines.agent import agent_build, agent_version
from machines.choices import EventKind, MachineState
from machines.models import Machine
from tests.factories import JobFactory, MachineFactory, UserFactory
from tests.fakes import FakeMachineShell

SHIPPED = agent_version()
OLD = "0.0.1"  # older than any agent the console ships


@pytest.fixture
def update_calls(monkeypatch):
    """Record the Update agent tasks instead of running them (they would SSH to the machine)."""
    calls = []
    monkeypatch.setattr(tasks.machine_update_agent, "delay", lambda job_id: calls.append(job_id))
    return calls


def operator():
    return UserFactory(username="ops", role=roles.OPERATOR)


# -- the offer: who may, and on which machines ----------------------------------------------------


@pytest.mark.django_db
def test_a_viewer_may_not_update_an_agent_and_is_told_which_role_may():
    offer = actions.update_agent_offer(MachineFactory(agent_version=OLD), busy=False, role=roles.VIEWER)
    assert (offer.ok, offer.forbidden) == (False, True)
    assert offer.why == "Your role is Viewer: updating a machine's agent needs an Operator."


@pytest.mark.django_db
@pytest.mark.parametrize(("state", "words"), [
    (MachineState.OFFLINE, "is offline: its agent can be updated once it beats again."),
    (MachineState.ENROLLING, "is being enrolled, which installs the current agent."),
    (MachineState.FAILED, "failed: select Refresh facts, which also installs the current agent."),
])
def test_only_a_healthy_machine_is_offered_the_update(state, words):
    machine = MachineFactory(name="lab-a", state=state, agent_version=OLD)
    offer = actions.update_agent_offer(machine, busy=False, role=roles.OPERATOR)
    assert (offer.ok, offer.why) == (False, f"lab-a {words}")


@pytest.mark.django_db
def test_a_machine_busy_with_another_job_is_refused_with_its_name():
    offer = actions.update_agent_offer(MachineFactory(name="lab-a", agent_version=OLD), busy=True, role=roles.OPERATOR)
    assert offer.why == "A job is already running on lab-a; wait for it to finish."


# -- the service ------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_updating_writes_the_job_with_its_steps_and_sends_it_after_commit(update_calls, django_capture_on_commit_callbacks):
    machine = MachineFactory(name="lab-a", agent_version=OLD)

    with django_capture_on_commit_callbacks(execute=True):
        job = services.machine_update_agent(machine=machine, user=operator())

    assert (job.kind, job.title, job.target_id) == ("machine.update_agent", "Update agent on lab-a", machine.pk)
    assert [s["name"] for s in job.steps] == ["Connect", "Check Python", "Install the agent", "Restart the heartbeat",
                                              "Check the version"]
    assert update_calls == [job.pk]
    machine.refresh_from_db()
    assert machine.state == MachineState.HEALTHY  # a cluster sees nothing of it


@pytest.mark.django_db
def test_an_offline_machine_is_refused_and_no_job_is_written(update_calls):
    machine = MachineFactory(name="lab-a", state=MachineState.OFFLINE, agent_version=OLD)
    with pytest.raises(ValidationError, match="lab-a is offline"):
        services.machine_update_agent(machine=machine, user=operator())
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_a_machine_with_a_job_running_is_refused(update_calls):
    machine = MachineFactory(name="lab-a", agent_version=OLD)
    JobFactory(target_id=machine.pk, state=JobState.RUNNING)
    with pytest.raises(ValidationError, match="A job is already running on lab-a"):
        services.machine_update_agent(machine=machine, user=operator())
    assert Job.objects.filter(kind="machine.update_agent").count() == 0


@pytest.mark.django_db
def test_a_viewer_is_refused_before_anything_is_looked_at(update_calls):
    with pytest.raises(PermissionDenied, match="needs an Operator"):
        services.machine_update_agent(machine=MachineFactory(agent_version=OLD), user=UserFactory(role=roles.VIEWER))
    with pytest.raises(PermissionDenied, match="needs an Operator"):
        services.machines_update_agent(machine_ids=[MachineFactory(agent_version=OLD).pk], user=UserFactory(role=roles.VIEWER))
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_a_selection_updates_the_outdated_machines_and_says_why_not_for_the_others(update_calls):
    old_a = MachineFactory(name="lab-a", agent_version=OLD)
    unknown = MachineFactory(name="lab-b", agent_version="")
    current = MachineFactory(name="lab-c")
    offline = MachineFactory(name="lab-d", state=MachineState.OFFLINE, agent_version=OLD)
    busy = MachineFactory(name="lab-e", agent_version=OLD)
    JobFactory(target_id=busy.pk, state=JobState.QUEUED)

    updates = services.machines_update_agent(
        machine_ids=[m.pk for m in (old_a, unknown, current, offline, busy)] + [987654], user=operator())

    assert [m.name for m in updates.started] == ["lab-a", "lab-b"]
    assert [j.title for j in updates.jobs] == ["Update agent on lab-a", "Update agent on lab-b"]
    assert [m.name for m in updates.up_to_date] == ["lab-c"]
    assert updates.refused == [
        "No machine has the id 987654.",
        "lab-d is offline: its agent can be updated once it beats again.",
        "A job is already running on lab-e; wait for it to finish.",
    ]


@pytest.mark.django_db
def test_an_empty_selection_is_refused():
    with pytest.raises(ValidationError, match="Select the machines"):
        services.machines_update_agent(machine_ids=[], user=operator())


# -- the job on the machine -------------------------------------------------------------------------


@pytest.fixture
def quiet(monkeypatch):
    monkeypatch.setattr(live, "push", lambda *args, **kwargs: None)


def run_update(machine: Machine, monkeypatch) -> Job:
    monkeypatch.setattr(tasks.machine_update_agent, "delay", lambda job_id: None)
    job = services.machine_update_agent(machine=machine)
    tasks.machine_update_agent(job.pk)
    return Job.objects.get(pk=job.pk)


def old_build_on_the_machine() -> FakeMachineShell:
    """Agent OLD installed, its heartbeat daemon running it: the machine the console last enrolled."""
    return FakeMachineShell(installed={f"fadenstack-agent-{OLD}.pyz": "0" * 64},
                            heartbeat={"running": True, "version": OLD, "pid": 4000, "token": "old-token"})


@pytest.mark.django_db(transaction=True)  # the job's beat reads the database on a connection of its own
def test_the_job_installs_the_new_agent_restarts_the_heartbeat_on_it_and_records_its_version(quiet, monkeypatch):
    machine = MachineFactory(name="lab-a", agent_version=OLD, agent_path=f"/opt/fadenstack/agent/fadenstack-agent-{OLD}.pyz")
    shell = old_build_on_the_machine().install(monkeypatch)
    token_before = machine.heartbeat_token_hash

    job = run_update(machine, monkeypatch)

    assert job.state == JobState.SUCCEEDED, job.error
    assert [s["state"] for s in job.steps] == [StepState.DONE] * 5
    new_path = f"/opt/fadenstack/agent/fadenstack-agent-{SHIPPED}.pyz"
    assert shell.files[new_path] == agent_build().sha256
    assert shell.heartbeat["version"] == SHIPPED and shell.heartbeat["pid"] == 4001
    assert set(shell.agent_paths) == {new_path}  # every command ran on the new agent
    machine.refresh_from_db()
    assert (machine.agent_version, machine.agent_path, machine.state) == (SHIPPED, new_path, MachineState.HEALTHY)
    assert machine.heartbeat_token_hash != token_before  # the restarted daemon beats with a token the console knows
    assert machine.events.filter(kind=EventKind.FACTS, message=f"Agent {OLD} → {SHIPPED} (Update agent).").exists()
    assert "Ray and the runtime run on" in job.log


@pytest.mark.django_db(transaction=True)
def test_the_job_never_stops_ray_the_runtime_or_any_other_daemon(quiet, monkeypatch):
    machine = MachineFactory(agent_version=OLD)
    shell = old_build_on_the_machine().install(monkeypatch)

    run_update(machine, monkeypatch)

    assert [c[:2] for c in shell.commands] == [["heartbeat", "status"], ["heartbeat", "start"], ["version"],
                                                ["heartbeat", "status"]]
    assert not any(c[0] in ("runtime", "ray", "blob", "image", "uninstall") or c[-1] == "stop" for c in shell.commands)


@pytest.mark.django_db(transaction=True)
def test_on_an_up_to_date_machine_the_job_checks_says_so_and_restarts_nothing(quiet, monkeypatch):
    machine = MachineFactory(agent_version=SHIPPED)
    shell = FakeMachineShell(installed={agent_build().filename: agent_build().sha256},
                             heartbeat={"running": True, "version": SHIPPED, "pid": 4000, "token": "t"}).install(monkeypatch)
    token_before = machine.heartbeat_token_hash

    job = run_update(machine, monkeypatch)

    assert job.state == JobState.SUCCEEDED, job.error
    assert shell.uploads == {} and shell.heartbeat["pid"] == 4000
    assert ["heartbeat", "start"] not in [c[:2] for c in shell.commands]
    assert f"Agent {SHIPPED} was installed and running already: nothing to change." in job.log
    assert job.steps[2]["detail"].endswith("(already there)")
    machine.refresh_from_db()
    assert machine.heartbeat_token_hash == token_before
    assert not machine.events.filter(kind=EventKind.FACTS).exists()


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_that_does_not_come_up_on_the_new_agent_fails_the_job_and_names_its_log(quiet, monkeypatch):
    machine = MachineFactory(agent_version=OLD)
    FakeMachineShell(installed={f"fadenstack-agent-{OLD}.pyz": "0" * 64}, stuck_heartbeat=True,
                     heartbeat={"running": True, "version": OLD, "pid": 4000, "token": "t"}).install(monkeypatch)

    job = run_update(machine, monkeypatch)

    assert job.state == JobState.FAILED
    assert job.error == (f"The heartbeat runs agent {OLD} after its restart, not agent {SHIPPED}; "
                         "its log on the machine is /opt/fadenstack/heartbeat.log.")
    machine.refresh_from_db()
    assert machine.agent_version == OLD


@pytest.mark.django_db(transaction=True)
def test_a_machine_that_cannot_be_reached_fails_the_job_in_its_words_and_stays_healthy(quiet, monkeypatch):
    machine = MachineFactory(agent_version=OLD)
    FakeMachineShell(unreachable="198.18.0.11 port 22 did not answer within 10 s.").install(monkeypatch)

    job = run_update(machine, monkeypatch)

    assert (job.state, job.error) == (JobState.FAILED, "198.18.0.11 port 22 did not answer within 10 s.")
    machine.refresh_from_db()
    assert (machine.state, machine.agent_version) == (MachineState.HEALTHY, OLD)


# -- the machine's page -----------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_page_of_a_machine_with_an_older_agent_offers_update_agent(client):
    machine = MachineFactory(name="lab-a", agent_version=OLD)
    client.force_login(operator())

    html = unescape(client.get(machine.get_absolute_url()).content.decode())

    assert f"Agent {OLD} · update available" in html
    assert f"This console ships agent <span class=\"mono\">{SHIPPED}</span>" in html
    assert f'formaction="{reverse("machines:update-agent", args=[machine.pk])}">Update agent</button>' in html


@pytest.mark.django_db
def test_a_viewer_sees_the_notice_with_the_button_greyed_out_and_the_reason(client):
    machine = MachineFactory(agent_version=OLD)
    client.force_login(UserFactory(role=roles.VIEWER))

    html = unescape(client.get(machine.get_absolute_url()).content.decode())

    assert "update available" in html
    assert "updating a machine's agent needs an Operator." in html
    assert reverse("machines:update-agent", args=[machine.pk]) not in html


@pytest.mark.django_db
def test_the_page_of_an_up_to_date_machine_shows_no_notice(admin_client):
    html = admin_client.get(MachineFactory().get_absolute_url()).content.decode()
    assert "machine-agent-update" not in html


@pytest.mark.django_db
def test_update_agent_from_the_page_starts_the_job_and_is_audited(client, update_calls):
    machine = MachineFactory(name="lab-a", agent_version=OLD)
    client.force_login(operator())

    response = client.post(reverse("machines:update-agent", args=[machine.pk]), follow=True)

    assert f"Updating the agent on lab-a to {SHIPPED}" in unescape(response.content.decode())
    assert Job.objects.filter(kind="machine.update_agent", target_id=machine.pk).exists()
    entry = AuditEntry.objects.get(action="machines:update-agent")
    assert (entry.outcome, entry.username) == (AuditOutcome.DONE, "ops")


@pytest.mark.django_db
def test_a_refused_update_from_the_page_is_said_and_audited_as_refused(client, update_calls):
    machine = MachineFactory(name="lab-a", state=MachineState.OFFLINE, agent_version=OLD)
    client.force_login(operator())

    response = client.post(reverse("machines:update-agent", args=[machine.pk]), follow=True)

    assert "lab-a is offline" in unescape(response.content.decode())
    entry = AuditEntry.objects.get(action="machines:update-agent")
    assert entry.outcome == AuditOutcome.REFUSED and "lab-a is offline" in entry.message


# -- the machines list --------------------------------------------------------------------------------


@pytest.mark.django_db
def test_the_list_marks_the_machines_whose_agent_is_older_and_counts_them(admin_client):
    old = MachineFactory(name="lab-a", agent_version=OLD)
    current = MachineFactory(name="lab-b")
    MachineFactory(name="lab-c", awaiting_host_key=True)  # no agent yet: nothing to update

    html = unescape(admin_client.get(reverse("machines:list")).content.decode())

    def row(machine):
        return html.split(f'id="machine-row-{machine.pk}"')[1].split("</tr>")[0]

    assert "update available" in row(old)
    assert "update available" not in row(current)
    assert f"1 machine runs an agent older than <span class=\"mono\">{SHIPPED}</span>" in html
    assert html.count("update available") == 1


@pytest.mark.django_db
def test_the_list_filters_the_machines_whose_agent_is_out_of_date(admin_client):
    MachineFactory(name="lab-a", agent_version=OLD)
    MachineFactory(name="lab-b")

    html = admin_client.get(reverse("machines:list"), {"agent": "outdated"}).content.decode()

    assert "lab-a" in html and "lab-b" not in html


@pytest.mark.django_db
def test_the_list_has_a_checkbox_per_row_and_an_update_agent_action_for_an_operator(client):
    machine = MachineFactory(agent_version=OLD)
    client.force_login(operator())

    html = client.get(reverse("machines:list")).content.decode()

    assert f'<input type="checkbox" name="machines" value="{machine.pk}" form="machine-selection"' in html
    assert f'action="{reverse("machines:update-agent-many")}"' in html
    assert 'data-needs-selection="machines" disabled' in html  # until something is ticked


@pytest.mark.django_db
def test_a_viewer_sees_update_agent_greyed_out_on_the_list(client):
    MachineFactory(agent_version=OLD)
    client.force_login(UserFactory(role=roles.VIEWER))

    html = unescape(client.get(reverse("machines:list")).content.decode())

    assert 'title="Your role is Viewer: updating a machine\'s agent needs an Operator."' in html


@pytest.mark.django_db
def test_the_selection_updates_what_it_can_and_says_the_rest_back_on_the_list(client, update_calls):
    old = MachineFactory(name="lab-a", agent_version=OLD)
    current = MachineFactory(name="lab-b")
    offline = MachineFactory(name="lab-c", state=MachineState.OFFLINE, agent_version=OLD)
    client.force_login(operator())

    response = client.post(reverse("machines:update-agent-many"),
                           {"machines": [old.pk, current.pk, offline.pk], "next": "/machines/?agent=outdated"})

    assert response.status_code == 302 and response["Location"] == "/machines/?agent=outdated"
    said = [str(m) for m in response.wsgi_request._messages]
    assert said == [f"Updating the agent to {SHIPPED} on lab-a; Ray and the runtime keep running.",
                    f"lab-b already runs agent {SHIPPED}.",
                    "lab-c is offline: its agent can be updated once it beats again."]
    assert list(Job.objects.filter(kind="machine.update_agent").values_list("target_id", flat=True)) == [old.pk]
    entry = AuditEntry.objects.get(action="machines:update-agent-many")
    assert entry.outcome == AuditOutcome.DONE and "lab-a" in entry.message


@pytest.mark.django_db
def test_the_selection_goes_back_only_to_the_list(client, update_calls):
    client.force_login(operator())
    response = client.post(reverse("machines:update-agent-many"),
                           {"machines": [MachineFactory().pk], "next": "https://elsewhere.example/"})
    assert response["Location"] == reverse("machines:list")


@pytest.mark.django_db
def test_a_selection_with_a_bad_id_is_a_400(client):
    client.force_login(operator())
    response = client.post(reverse("machines:update-agent-many"), {"machines": ["١٢"]})
    assert response.status_code == 400

