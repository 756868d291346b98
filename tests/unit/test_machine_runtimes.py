"""The container runtime a machine uses: the rule (the config's driver, else the choice, else Docker,
else Podman, else none), what enrolment records from the facts, the administrator's choice and its
refusals, and how the machine's page and the machines list show it."""
import re
from html import unescape

import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.test import Client
from django.utils import timezone

from console import roles
from console.choices import AuditOutcome
from console.models import AuditEntry
from machines import runtimes, services
from machines.choices import EventKind
from machines.runtimes import Runtime
from tests.factories import MachineFactory, UserFactory

DOCKER = Runtime("docker", "27.3.1")
PODMAN = Runtime("podman", "4.9.3")
PROCESS = Runtime("process", "0.1.0")
PODMAN_43 = Runtime("podman", "4.3.1")


# -- the rule -------------------------------------------------------------------------------------


def test_automatic_uses_the_only_engine_found():
    assert runtimes.in_use(configured=None, found=[PODMAN], choice="") == PODMAN
    assert runtimes.in_use(configured=None, found=[DOCKER], choice="") == DOCKER


def test_automatic_uses_docker_when_the_machine_has_both():
    assert runtimes.in_use(configured=None, found=[DOCKER, PODMAN], choice="") == DOCKER
    assert runtimes.in_use(configured=None, found=[PODMAN, DOCKER], choice="") == DOCKER


def test_the_administrator_s_choice_is_honoured_when_the_machine_has_it():
    assert runtimes.in_use(configured=None, found=[DOCKER, PODMAN], choice="podman") == PODMAN


def test_a_choice_the_machine_no_longer_has_falls_back_to_automatic():
    assert runtimes.in_use(configured=None, found=[DOCKER], choice="podman") == DOCKER


def test_the_driver_the_machine_s_config_names_wins_over_everything():
    assert runtimes.in_use(configured=PROCESS, found=[DOCKER, PODMAN], choice="podman") == PROCESS


def test_a_machine_with_no_engine_and_no_configured_driver_has_no_runtime():
    assert runtimes.in_use(configured=None, found=[], choice="") is None
    assert runtimes.in_use(configured=None, found=[], choice="docker") is None


def test_the_sentence_for_no_runtime_names_the_machine():
    assert runtimes.no_runtime("lab-x") == "No container runtime on lab-x: install Docker or Podman"


@pytest.mark.parametrize(("facts", "found", "configured"), [
    # The agent lists every engine, and names the one it would use.
    ({"container_runtime": {"name": "docker", "version": "27.3.1"},
      "container_runtimes": [{"name": "docker", "version": "27.3.1"}, {"name": "podman", "version": "4.9.3"}]},
     [DOCKER, PODMAN], None),
    # The lab: the config names "process", and Podman is there too.
    ({"container_runtime": {"name": "process", "version": "0.1.0"}, "container_runtimes": [{"name": "podman", "version": "4.9.3"}]},
     [PODMAN], PROCESS),
    # An agent older than container_runtimes: the one it names, when it is an engine.
    ({"container_runtime": {"name": "podman", "version": "4.9.3"}}, [PODMAN], None),
    ({"container_runtime": {"name": "process", "version": "0.1.0"}}, [], PROCESS),
    # The config names Docker on a machine that also has Podman: the agent says so.
    ({"container_runtime": {"name": "docker", "version": "27.3.1", "configured": True},
      "container_runtimes": [{"name": "docker", "version": "27.3.1"}, {"name": "podman", "version": "4.9.3"}]},
     [DOCKER, PODMAN], DOCKER),
    ({"container_runtime": None, "container_runtimes": []}, [], None),
    # Docker's client without its daemon (the lab's machines): it runs nothing, Podman does.
    ({"container_runtime": {"name": "podman", "version": "4.3.1"},
      "container_runtimes": [{"name": "docker", "version": None, "answers": False},
                             {"name": "podman", "version": "4.3.1", "answers": True}]},
     [PODMAN_43], None),
    # What is not an engine, or not a runtime at all, is left out.
    ({"container_runtime": "docker", "container_runtimes": [{"name": "lxc", "version": "5"}, "podman", {"version": "1"}]}, [], None),
])
def test_the_facts_give_the_engines_found_and_the_configured_driver(facts, found, configured):
    assert runtimes.found_in(facts) == found
    assert runtimes.configured_in(facts) == configured


def test_choosing_an_engine_the_machine_does_not_have_is_refused_in_words():
    assert runtimes.choice_refusal(machine_name="gpu-a", choice="podman", found=[DOCKER]) == (
        "gpu-a has no Podman: it has Docker. Install Podman there and select Refresh facts first.")
    assert runtimes.choice_refusal(machine_name="gpu-a", choice="docker", found=[]) == (
        "gpu-a has no Docker: it has no container runtime. Install Docker there and select Refresh facts first.")
    assert runtimes.choice_refusal(machine_name="gpu-a", choice="lxc", found=[DOCKER]).startswith(
        "Choose Docker or Podman, or automatic")
    assert runtimes.choice_refusal(machine_name="gpu-a", choice="", found=[]) == ""


# -- enrolment records them -----------------------------------------------------------------------


@pytest.mark.django_db
def test_facts_record_every_engine_found_and_docker_in_use_when_both(machine_facts):
    machine = MachineFactory(no_runtime=True)

    services.machine_facts_apply(machine=machine, facts=machine_facts(
        container_runtime={"name": "docker", "version": "27.3.1"},
        container_runtimes=[{"name": "docker", "version": "27.3.1"}, {"name": "podman", "version": "4.9.3"}]))

    machine.refresh_from_db()
    assert machine.container_runtimes == [DOCKER.as_dict(), PODMAN.as_dict()]
    assert (machine.container_runtime, machine.container_runtime_version, machine.configured_runtime) == ("docker", "27.3.1", "")


@pytest.mark.django_db
def test_facts_keep_the_choice_and_use_it(machine_facts):
    machine = MachineFactory(both_runtimes=True, runtime_choice="podman")

    services.machine_facts_apply(machine=machine, facts=machine_facts(
        container_runtime={"name": "docker", "version": "27.3.1"},
        container_runtimes=[{"name": "docker", "version": "27.3.1"}, {"name": "podman", "version": "5.0.1"}]))

    machine.refresh_from_db()
    assert (machine.runtime_choice, machine.container_runtime, machine.container_runtime_version) == ("podman", "podman", "5.0.1")


@pytest.mark.django_db
def test_the_lab_s_process_driver_is_in_use_whatever_else_is_found(machine_facts):
    machine = MachineFactory(no_runtime=True)

    services.machine_facts_apply(machine=machine, facts=machine_facts(
        container_runtime={"name": "process", "version": "0.1.0"}, container_runtimes=[{"name": "podman", "version": "4.9.3"}]))

    machine.refresh_from_db()
    assert (machine.container_runtime, machine.configured_runtime) == ("process", "process")
    assert machine.container_runtimes == [PODMAN.as_dict()]


@pytest.mark.django_db
def test_facts_without_any_engine_leave_the_machine_without_a_runtime(machine_facts):
    machine = MachineFactory()

    services.machine_facts_apply(machine=machine, facts=machine_facts(container_runtime=None, container_runtimes=[]))

    machine.refresh_from_db()
    assert (machine.container_runtime, machine.container_runtimes, machine.runtime) == ("", [], None)
    assert machine.no_runtime() == f"No container runtime on {machine.name}: install Docker or Podman"


@pytest.fixture
def machine_facts():
    """The agent's facts of a small machine, with the runtimes given."""
    def facts(**runtime_fields) -> dict:
        return {"agent_version": "0.1.0", "hostname": "node", "arch": "x86_64", "cpu_count": 8, "memory_mib": 1024,
                "store": {}, "accelerators": [], "interfaces": [], **runtime_fields}
    return facts


# -- the administrator's choice -------------------------------------------------------------------


@pytest.mark.django_db
def test_an_administrator_chooses_podman_and_the_machine_records_it_in_its_history():
    machine = MachineFactory(both_runtimes=True)

    services.machine_runtime_choose(machine=machine, choice="podman", user=UserFactory())

    machine.refresh_from_db()
    assert (machine.runtime_choice, machine.container_runtime, machine.container_runtime_version) == ("podman", "podman", "4.9.3")
    event = machine.events.get(kind=EventKind.RUNTIME)
    assert event.message == "Container runtime: Podman in place of Automatic; in use: Podman."


@pytest.mark.django_db
def test_going_back_to_automatic_uses_docker_again():
    machine = MachineFactory(both_runtimes=True, runtime_choice="podman", container_runtime="podman")

    services.machine_runtime_choose(machine=machine, choice="", user=UserFactory())

    machine.refresh_from_db()
    assert (machine.runtime_choice, machine.container_runtime) == ("", "docker")


@pytest.mark.django_db
def test_choosing_an_engine_the_machine_does_not_have_is_refused_and_changes_nothing():
    machine = MachineFactory(name="gpu-a")

    with pytest.raises(ValidationError) as refused:
        services.machine_runtime_choose(machine=machine, choice="podman", user=UserFactory())

    assert refused.value.message_dict == {
        "runtime_choice": ["gpu-a has no Podman: it has Docker. Install Podman there and select Refresh facts first."]}
    machine.refresh_from_db()
    assert (machine.runtime_choice, machine.container_runtime) == ("", "docker")
    assert not machine.events.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("role", [roles.VIEWER, roles.OPERATOR])
def test_only_an_administrator_may_choose_the_runtime(role):
    machine = MachineFactory(both_runtimes=True)

    with pytest.raises(PermissionDenied, match=f"Your role is {role}: choosing a machine's container runtime needs an Administrator."):
        services.machine_runtime_choose(machine=machine, choice="podman", user=UserFactory(role=role))

    machine.refresh_from_db()
    assert machine.runtime_choice == ""


# -- the machine's page and the list --------------------------------------------------------------


def runtime_card(html: str) -> str:
    return unescape(html[html.index('id="machine-runtime"'):html.index("</section>", html.index('id="machine-runtime"'))])


@pytest.mark.django_db
def test_a_machine_without_a_runtime_says_so_on_its_page(admin_client):
    machine = MachineFactory(name="lab-x", no_runtime=True, facts_at=timezone.now())

    card = runtime_card(admin_client.get(machine.get_absolute_url()).content.decode())

    assert "No container runtime on lab-x: install Docker or Podman" in card
    assert 'name="runtime_choice"' not in card


@pytest.mark.django_db
def test_the_page_shows_the_runtime_in_use_what_was_found_and_the_choice(admin_client):
    machine = MachineFactory(both_runtimes=True, facts_at=timezone.now())

    card = runtime_card(admin_client.get(machine.get_absolute_url()).content.decode())

    assert re.search(r"In use</dt>\s*<dd><strong>Docker</strong> <span class=\"mono\">27.3.1</span>", card)
    assert "automatic" in card and "Podman <span class=\"mono\">4.9.3</span>" in card
    assert re.search(r'<input type="radio" name="runtime_choice" value="" checked>', card)
    assert re.search(r'<input type="radio" name="runtime_choice" value="podman">', card)
    assert f'hx-post="/machines/{machine.pk}/runtime/"' in card


@pytest.mark.django_db
def test_an_engine_that_was_not_found_cannot_be_chosen_on_the_page(admin_client):
    machine = MachineFactory(name="gpu-a", facts_at=timezone.now())

    card = runtime_card(admin_client.get(machine.get_absolute_url()).content.decode())

    assert '<input type="radio" name="runtime_choice" value="podman" disabled>' in card
    assert "Not found on gpu-a." in card


@pytest.mark.django_db
def test_the_lab_s_configured_driver_is_shown_without_a_choice(admin_client):
    machine = MachineFactory(container_runtime="process", configured_runtime="process", container_runtime_version="0.1.0",
                             container_runtimes=[], facts_at=timezone.now())

    card = runtime_card(admin_client.get(machine.get_absolute_url()).content.decode())

    assert "Process" in card and "set by its agent config" in card and 'name="runtime_choice"' not in card


@pytest.mark.django_db
def test_an_operator_sees_the_choice_greyed_out_with_the_reason():
    machine = MachineFactory(both_runtimes=True, facts_at=timezone.now())
    client = Client()
    client.force_login(UserFactory(role=roles.OPERATOR))

    card = runtime_card(client.get(machine.get_absolute_url()).content.decode())

    assert "<fieldset disabled>" in card
    assert "Your role is Operator: choosing a machine's container runtime needs an Administrator." in card


@pytest.mark.django_db
def test_the_page_s_form_saves_the_choice_and_the_audit_trail_records_it(admin_client):
    machine = MachineFactory(both_runtimes=True, facts_at=timezone.now())

    response = admin_client.post(f"/machines/{machine.pk}/runtime/", {"runtime_choice": "podman"}, HTTP_HX_REQUEST="true")

    assert response.status_code == 200 and response["HX-Redirect"] == machine.get_absolute_url()
    machine.refresh_from_db()
    assert machine.container_runtime == "podman"
    entry = AuditEntry.objects.get(action="machines:runtime")
    assert entry.outcome == AuditOutcome.DONE
    assert entry.message == f"{machine.name} runs its clusters' containers with Podman 4.9.3 from their next start."


@pytest.mark.django_db
def test_the_page_s_form_shows_the_refusal_and_the_audit_trail_records_it(admin_client):
    machine = MachineFactory(name="gpu-a", facts_at=timezone.now())

    response = admin_client.post(f"/machines/{machine.pk}/runtime/", {"runtime_choice": "podman"}, follow=True)

    assert "gpu-a has no Podman: it has Docker." in unescape(response.content.decode())
    entry = AuditEntry.objects.get(action="machines:runtime")
    assert entry.outcome == AuditOutcome.REFUSED and entry.message.startswith("gpu-a has no Podman")


@pytest.mark.django_db
def test_the_machines_list_shows_each_machine_s_runtime(admin_client):
    MachineFactory(name="gpu-a", facts_at=timezone.now())
    MachineFactory(name="gpu-b", no_runtime=True, facts_at=timezone.now())

    html = unescape(admin_client.get("/machines/").content.decode())

    assert "<th>Runtime</th>" in html
    assert '<span title="Docker 27.3.1">Docker</span>' in html
    assert '<span class="tag tag--warn" title="No container runtime on gpu-b: install Docker or Podman">none</span>' in html
