"""/api/machines/: what automation sees, and that bad input never reaches a machine."""
import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from console.choices import JobState
from console.models import Job
from machines import remote
from machines.choices import MachineState
from machines.models import Machine, MachineEvent
from tests.factories import (
    AcceleratorFactory,
    JobFactory,
    MachineFactory,
    NetworkInterfaceFactory,
    fingerprint_for,
)

pytestmark = pytest.mark.django_db

GOOD = {"name": "gpu-01", "address": "198.18.0.11", "ssh_port": 22, "ssh_user": "root"}


# -- authentication ---------------------------------------------------------------------------


def test_machines_need_authentication_and_say_so_in_json(anonymous_api_client):
    response = anonymous_api_client.get("/api/machines/")

    assert response.status_code == 401
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"message": "Authentication credentials were not provided."}


def test_a_wrong_token_is_refused_with_a_message(anonymous_api_client):
    anonymous_api_client.credentials(HTTP_AUTHORIZATION="Token not-a-real-token")
    response = anonymous_api_client.get("/api/machines/")
    assert response.status_code == 401
    assert "token" in response.json()["message"].lower()


def test_machines_answer_a_token(api_client):
    assert api_client.get("/api/machines/").status_code == 200


# -- reading ------------------------------------------------------------------------------------


def test_the_machine_list_is_paginated(api_client):
    MachineFactory.create_batch(51)

    first = api_client.get("/api/machines/").json()
    second = api_client.get(first["next"]).json()

    assert first["count"] == 51
    assert len(first["results"]) == 50
    assert "page=2" in first["next"]
    assert len(second["results"]) == 1 and second["next"] is None


def test_a_machine_reads_with_its_state_facts_accelerators_and_interfaces(api_client):
    machine = MachineFactory(name="h100-node-1", arch="x86_64", agent_version="0.1.0")
    AcceleratorFactory.create_batch(8, machine=machine, model="NVIDIA H100 80GB HBM3", memory_mib=81559)
    NetworkInterfaceFactory(machine=machine, name="eno1", default_route=True, management=True)

    body = api_client.get(f"/api/machines/{machine.pk}/").json()

    assert body["id"] == machine.pk
    assert body["name"] == "h100-node-1"
    assert body["state"] == "healthy" and body["state_display"] == "Healthy"
    assert body["arch"] == "x86_64"
    assert body["agent_version"] == "0.1.0"
    assert body["last_seen"] is not None
    accelerators = body["accelerators"]
    assert (accelerators["count"], accelerators["model"], accelerators["memory_mib"]) == (8, "NVIDIA H100 80GB HBM3", 81559)
    assert [d["index"] for d in accelerators["devices"]] == list(range(8))
    assert body["interfaces"] == [
        {"name": "eno1", "kind": "physical", "addresses": [f"{machine.address}/24"], "speed_mbps": 100000,
         "default_route": True, "management": True, "mac": body["interfaces"][0]["mac"], "mtu": 1500, "state": "up"}
    ]


def test_a_machine_without_accelerators_reads_as_none(api_client):
    machine = MachineFactory()
    accelerators = api_client.get(f"/api/machines/{machine.pk}/").json()["accelerators"]
    assert accelerators == {"count": 0, "model": "", "memory_mib": None, "devices": []}


def test_an_unknown_machine_is_a_404_with_a_message(api_client):
    response = api_client.get("/api/machines/999999/")
    assert response.status_code == 404
    assert response.json()["message"]


def list_queries(api_client) -> int:
    with CaptureQueriesContext(connection) as queries:
        assert api_client.get("/api/machines/").status_code == 200
    return len(queries)


def test_listing_machines_costs_the_same_queries_for_ten_machines_as_for_two(api_client):
    def machine_with_accelerators():
        machine = MachineFactory()
        AcceleratorFactory.create_batch(8, machine=machine)
        NetworkInterfaceFactory(machine=machine)

    for _ in range(2):
        machine_with_accelerators()
    two = list_queries(api_client)
    for _ in range(8):
        machine_with_accelerators()
    assert list_queries(api_client) == two


# -- adding ---------------------------------------------------------------------------------------

BAD_INPUT = {
    "a command in the name": ({"name": "a;rm -rf /"}, "name"),
    "a command substitution in the name": ({"name": "$(id)"}, "name"),
    "an ssh option as the address": ({"address": "-oProxyCommand=x"}, "address"),
    "a command in the address": ({"address": "a;rm -rf /"}, "address"),
    "a command substitution in the address": ({"address": "$(id)"}, "address"),
    "backticks in the address": ({"address": "`id`"}, "address"),
    "an ssh option as the user": ({"ssh_user": "-oProxyCommand=x"}, "ssh_user"),
    "a command substitution in the user": ({"ssh_user": "$(id)"}, "ssh_user"),
    "port 0": ({"ssh_port": 0}, "ssh_port"),
    "port 70000": ({"ssh_port": 70000}, "ssh_port"),
    "port -1": ({"ssh_port": -1}, "ssh_port"),
    "port true": ({"ssh_port": True}, "ssh_port"),
    "a port that is not a number": ({"ssh_port": "22; id"}, "ssh_port"),
    "an empty name": ({"name": ""}, "name"),
    "an empty address": ({"address": ""}, "address"),
    "a 10 kB name": ({"name": "a" * 10240}, "name"),
    "a 10 kB address": ({"address": "a" * 10240}, "address"),
    "a 10 kB user": ({"ssh_user": "a" * 10240}, "ssh_user"),
    "a malformed fingerprint": ({"host_key_fingerprint": "SHA256:$(id)"}, "host_key_fingerprint"),
    "a 10 kB fingerprint": ({"host_key_fingerprint": "SHA256:" + "A" * 10240}, "host_key_fingerprint"),
    "no name at all": ({"name": None}, "name"),
}


@pytest.mark.parametrize("change, field", BAD_INPUT.values(), ids=BAD_INPUT.keys())
def test_adding_a_machine_with_bad_input_is_a_400_naming_the_problem_before_any_ssh(api_client, no_ssh, change, field):
    data = {**GOOD, **change}
    data = {k: v for k, v in data.items() if v is not None}

    response = api_client.post("/api/machines/", data, format="json")

    assert response.status_code == 400
    body = response.json()
    assert body["message"].startswith(f"{field}: ")
    assert len(body["message"]) > len(field) + 10
    assert field in body["errors"]
    assert not Machine.objects.exists()


def test_adding_a_machine_whose_name_is_taken_is_a_400_before_any_ssh(api_client, no_ssh):
    MachineFactory(name="gpu-01")
    response = api_client.post("/api/machines/", GOOD, format="json")
    assert response.status_code == 400
    assert response.json()["message"].startswith("name: ")
    assert Machine.objects.count() == 1


def test_adding_a_machine_at_an_ipv6_address_with_a_hostile_scope_id_never_reaches_ssh(api_client, no_ssh):
    response = api_client.post("/api/machines/", {**GOOD, "address": "fe80::1%$(id)"}, format="json")
    assert response.status_code == 400


def test_adding_a_machine_that_cannot_be_reached_is_a_400_and_stores_nothing(api_client, monkeypatch):
    def unreachable(address, port):
        raise remote.RemoteError(f"Could not reach {address} port {port}: Connection refused.", kind="unreachable")

    monkeypatch.setattr(remote, "scan_host_key", unreachable)

    response = api_client.post("/api/machines/", GOOD, format="json")

    assert response.status_code == 400
    assert response.json()["message"] == "address: Could not reach 198.18.0.11 port 22: Connection refused."
    assert not Machine.objects.exists()
    assert not Job.objects.exists()


def test_adding_a_machine_with_a_fingerprint_it_does_not_offer_is_a_400_naming_both(
    api_client, machine_offers, offered_fingerprint, enrol_calls
):
    expected = fingerprint_for("the key the administrator was told")

    response = api_client.post("/api/machines/", {**GOOD, "host_key_fingerprint": expected}, format="json")

    assert response.status_code == 400
    message = response.json()["message"]
    assert message.startswith("host_key_fingerprint: ")
    assert offered_fingerprint in message and expected in message
    assert not Machine.objects.exists()
    assert not Job.objects.exists()
    assert enrol_calls == []


def test_adding_a_machine_without_a_fingerprint_waits_for_its_host_key(api_client, machine_offers, offered_fingerprint):
    response = api_client.post("/api/machines/", {**GOOD, "ssh_port": 2222, "ssh_user": "ubuntu"}, format="json")

    assert response.status_code == 201
    body = response.json()
    assert body["state"] == MachineState.HOST_KEY
    assert body["offered_host_key_fingerprint"] == offered_fingerprint
    assert body["host_key_fingerprint"] == ""
    assert machine_offers == [("198.18.0.11", 2222)]
    machine = Machine.objects.get(pk=body["id"])
    assert (machine.name, machine.ssh_port, machine.ssh_user) == ("gpu-01", 2222, "ubuntu")
    assert not Job.objects.exists()


def test_adding_a_machine_with_the_fingerprint_it_offers_starts_enrolment(
    api_client, machine_offers, offered_fingerprint, enrol_calls, django_capture_on_commit_callbacks
):
    with django_capture_on_commit_callbacks(execute=True):
        response = api_client.post("/api/machines/", {**GOOD, "host_key_fingerprint": offered_fingerprint}, format="json")

    assert response.status_code == 201
    machine = Machine.objects.get(pk=response.json()["id"])
    assert machine.state == MachineState.ENROLLING
    assert machine.host_key_fingerprint == offered_fingerprint
    job = Job.objects.get(target_type="machine", target_id=machine.pk)
    assert enrol_calls == [job.pk]


# -- host keys, refresh, delete ---------------------------------------------------------------------


def test_trusting_a_host_key_other_than_the_offered_one_is_a_400(api_client, enrol_calls):
    machine = MachineFactory(awaiting_host_key=True)
    wrong = fingerprint_for("not the one")

    response = api_client.post(f"/api/machines/{machine.pk}/trust-host-key/", {"fingerprint": wrong}, format="json")

    assert response.status_code == 400
    assert machine.offered_host_key_fingerprint in response.json()["message"]
    machine.refresh_from_db()
    assert machine.state == MachineState.HOST_KEY and machine.host_key_fingerprint == ""
    assert enrol_calls == []


def test_trusting_the_offered_host_key_is_a_202_that_queues_enrolment(
    api_client, enrol_calls, django_capture_on_commit_callbacks
):
    machine = MachineFactory(awaiting_host_key=True)
    offered = machine.offered_host_key_fingerprint

    with django_capture_on_commit_callbacks(execute=True):
        response = api_client.post(f"/api/machines/{machine.pk}/trust-host-key/", {"fingerprint": offered}, format="json")

    assert response.status_code == 202
    job = response.json()
    assert job["kind"] == "machine.enrol" and job["state"] == JobState.QUEUED
    assert [step["name"] for step in job["steps"]][0] == "Connect"
    assert enrol_calls == [job["id"]]
    machine.refresh_from_db()
    assert machine.host_key_fingerprint == offered
    assert machine.state == MachineState.ENROLLING


def test_trusting_a_host_key_without_one_is_a_400(api_client):
    machine = MachineFactory(awaiting_host_key=True)
    response = api_client.post(f"/api/machines/{machine.pk}/trust-host-key/", {}, format="json")
    assert response.status_code == 400
    assert response.json()["message"].startswith("fingerprint: ")


def test_refresh_is_a_202_with_the_job(api_client, enrol_calls, django_capture_on_commit_callbacks):
    machine = MachineFactory()

    with django_capture_on_commit_callbacks(execute=True):
        response = api_client.post(f"/api/machines/{machine.pk}/refresh/")

    assert response.status_code == 202
    job = response.json()
    assert job["kind"] == "machine.refresh"
    assert job["title"] == f"Refresh facts of {machine.name}"
    assert enrol_calls == [job["id"]]


def test_refresh_while_a_job_runs_is_a_400_that_says_so(api_client, enrol_calls):
    machine = MachineFactory()
    JobFactory(target_id=machine.pk, state=JobState.RUNNING)

    response = api_client.post(f"/api/machines/{machine.pk}/refresh/")

    assert response.status_code == 400
    assert "already running" in response.json()["message"]
    assert enrol_calls == []


def test_deleting_a_machine_forgets_it(api_client):
    machine = MachineFactory()
    AcceleratorFactory(machine=machine)

    response = api_client.delete(f"/api/machines/{machine.pk}/")

    assert response.status_code == 204
    assert not Machine.objects.exists()
    assert not MachineEvent.objects.exists()
    assert api_client.get(f"/api/machines/{machine.pk}/").status_code == 404


def test_deleting_a_machine_that_belongs_to_a_cluster_is_refused_with_a_message(api_client):
    from clusters.models import Cluster, ClusterMember

    machine = MachineFactory()
    ClusterMember.objects.create(cluster=Cluster.objects.create(name="serve-1"), machine=machine)
    api_client.raise_request_exception = False

    response = api_client.delete(f"/api/machines/{machine.pk}/")

    assert response.status_code in (400, 409)
    assert "cluster" in response.json()["message"]
    assert Machine.objects.filter(pk=machine.pk).exists()


# -- the container runtime --------------------------------------------------------------------------


def test_a_machine_reads_with_the_runtime_in_use_every_engine_found_and_the_choice(api_client):
    machine = MachineFactory(both_runtimes=True)

    body = api_client.get(f"/api/machines/{machine.pk}/").json()

    assert (body["container_runtime"], body["container_runtime_version"], body["runtime_choice"]) == ("docker", "27.3.1", "")
    assert body["container_runtimes"] == [{"name": "docker", "version": "27.3.1"}, {"name": "podman", "version": "4.9.3"}]
    assert body["configured_runtime"] == ""


def test_patching_the_runtime_choice_uses_it_and_answers_with_the_machine(api_client):
    machine = MachineFactory(both_runtimes=True)

    response = api_client.patch(f"/api/machines/{machine.pk}/", {"runtime_choice": "podman"}, format="json")

    assert response.status_code == 200, response.content
    body = response.json()
    assert (body["runtime_choice"], body["container_runtime"], body["container_runtime_version"]) == ("podman", "podman", "4.9.3")
    assert MachineEvent.objects.filter(machine=machine, kind="runtime").exists()


def test_an_engine_the_machine_does_not_have_is_a_400_that_says_what_it_has(api_client):
    machine = MachineFactory(name="gpu-a")

    response = api_client.patch(f"/api/machines/{machine.pk}/", {"runtime_choice": "podman"}, format="json")

    assert response.status_code == 400
    assert response.json()["errors"] == {
        "runtime_choice": ["gpu-a has no Podman: it has Docker. Install Podman there and select Refresh facts first."]}
    machine.refresh_from_db()
    assert machine.runtime_choice == ""


@pytest.mark.parametrize("value", ["lxc", "Docker", "process", None, 3, ["docker"]])
def test_a_runtime_choice_that_is_no_engine_is_a_400_that_names_the_choices(api_client, value):
    machine = MachineFactory()

    response = api_client.patch(f"/api/machines/{machine.pk}/", {"runtime_choice": value}, format="json")

    assert response.status_code == 400
    [message] = response.json()["errors"]["runtime_choice"]
    assert message.startswith('Choose "docker", "podman" or "" (automatic)') or message == "This field may not be null."
    machine.refresh_from_db()
    assert machine.runtime_choice == ""


def test_a_patch_without_a_runtime_choice_is_a_400_that_asks_for_it(api_client):
    response = api_client.patch(f"/api/machines/{MachineFactory().pk}/", {"name": "renamed"}, format="json")
    assert response.status_code == 400 and response.json()["errors"] == {"runtime_choice": ["This field is required."]}


# -- the schema ------------------------------------------------------------------------------------


def test_the_openapi_schema_describes_the_machines_endpoints(api_client):
    response = api_client.get("/api/schema/")

    assert response.status_code == 200
    text = response.content.decode()
    assert text.startswith("openapi: 3")
    assert "/api/machines/:" in text
    assert "/api/machines/{id}/trust-host-key/:" in text
