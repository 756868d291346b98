"""/api/clusters/<id>/...: what the cluster page does, for automation. Every refusal is a 400 whose
``message`` is the service's own words, and changes nothing; the tasks are only enqueued (recorded here)."""
from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from clusters import tasks
from clusters.choices import CheckOutcome, CheckTrigger, ClusterState, Role
from clusters.models import Cluster, ClusterMember, HealthCheck, Transfer
from console.choices import JobState
from console.models import Job
from machines.choices import MachineState
from machines.models import Machine
from deployments.models import Deployment
from tests.builders import NETWORK, build, cluster_of, deployment_of, gpu_machine
from tests.factories import AcceleratorFactory, JobFactory

pytestmark = pytest.mark.django_db

MANAGEMENT = "198.18.0.0/24"  # the other network the machines share with the cluster's (NETWORK)


# -- the builds and the clusters (tests/builders.py) -----------------------------------------------


@pytest.fixture
def runtime():
    return build("2.1.0")


@pytest.fixture
def room(runtime):
    """gpu-room: two machines, running on 198.18.1.0/24."""
    return cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=runtime)


@pytest.fixture
def stopped_room(runtime):
    return cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=runtime, state=ClusterState.STOPPED)


@pytest.fixture
def queued(monkeypatch):
    """The tasks the API enqueued after commit, instead of running them (they would SSH to machines)."""
    calls = []
    monkeypatch.setattr(tasks.cluster_job, "delay", lambda job_id: calls.append(("cluster_job", job_id)))
    monkeypatch.setattr(tasks.cluster_check, "delay", lambda *args: calls.append(("cluster_check", *args)))
    return calls


@pytest.fixture
def post(api_client, queued, django_capture_on_commit_callbacks):
    """POST (or another method) through the API, running what it left for after commit."""

    def send(url, body=None, method="post"):
        with django_capture_on_commit_callbacks(execute=True):
            return getattr(api_client, method)(url, body, format="json")

    return send


def snapshot(cluster: Cluster) -> dict:
    """What a refusal must leave alone: the cluster's row, its members' rows, and the jobs."""
    row = Cluster.objects.filter(pk=cluster.pk).values().first()
    members = list(ClusterMember.objects.filter(cluster_id=cluster.pk).order_by("pk").values())
    return {"cluster": row, "members": members, "jobs": Job.objects.count()}


def refused(response, cluster, before, queued, words):
    assert response.status_code == 400, response.content
    assert words in response.json()["message"]
    assert snapshot(cluster) == before
    assert queued == []


# -- authentication and unknown clusters -----------------------------------------------------------

ENDPOINTS = [
    ("post", "stop/"),
    ("post", "start/"),
    ("post", "check/"),
    ("post", "retry/"),
    ("post", "switch-runtime/"),
    ("post", "change-network/"),
    ("post", "machines/"),
    ("delete", "machines/1/"),
    ("delete", ""),
    ("get", "health-checks/"),
    ("get", "join-candidates/"),
]


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_every_cluster_action_needs_authentication_and_says_so_in_json(anonymous_api_client, room, queued, method, path):
    before = snapshot(room)

    response = getattr(anonymous_api_client, method)(f"/api/clusters/{room.pk}/{path}")

    assert response.status_code == 401
    assert response.json() == {"message": "Authentication credentials were not provided."}
    assert snapshot(room) == before


def test_a_browser_session_without_its_csrf_token_cannot_stop_a_cluster(admin_user, room, queued):
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(admin_user)

    response = client.post(f"/api/clusters/{room.pk}/stop/")

    assert response.status_code == 403
    assert "CSRF" in response.json()["message"]
    assert Cluster.objects.get(pk=room.pk).state == ClusterState.RUNNING


@pytest.mark.parametrize(("method", "path"), ENDPOINTS)
def test_every_cluster_action_on_an_unknown_cluster_is_a_404_with_a_message(api_client, queued, method, path):
    response = getattr(api_client, method)(f"/api/clusters/999999/{path}", {}, format="json")

    assert response.status_code == 404
    assert response.json()["message"]
    assert queued == []


# -- reading ----------------------------------------------------------------------------------------


def test_a_cluster_reads_with_its_restarts_next_retry_last_status_and_members_last_status(api_client, room):
    at = timezone.now()
    Cluster.objects.filter(pk=room.pk).update(restart_attempt=2, next_retry_at=at, last_status_at=at)
    ClusterMember.objects.filter(cluster=room, role=Role.HEAD).update(last_status={"ray": "running"})

    body = api_client.get(f"/api/clusters/{room.pk}/").json()

    assert body["restart_attempt"] == 2
    assert body["next_retry_at"] is not None and body["last_status_at"] is not None
    assert body["machines_up"] == 2 and body["accelerators"] == 16
    head = next(m for m in body["members"] if m["role"] == "head")
    assert head["last_status"] == {"ray": "running"}


def test_the_list_gives_each_member_without_its_last_status_and_the_cluster_gives_it(api_client, room):
    ClusterMember.objects.filter(cluster=room, role=Role.HEAD).update(last_status={"ray": "running"})
    Transfer.objects.create(member=room.members.get(role=Role.HEAD), digest=room.members.first().runtime_image.digest,
                            what="the runtime image", source="the server", bytes_done=512, bytes_total=1024)

    listed = api_client.get("/api/clusters/").json()["results"][0]
    one = api_client.get(f"/api/clusters/{room.pk}/").json()

    assert all("last_status" not in m for m in listed["members"])
    assert next(m for m in one["members"] if m["role"] == "head")["last_status"] == {"ray": "running"}
    assert one.pop("deployments") == []  # the cluster's detail adds its deployments (deployments/api.py)
    assert one.pop("connection")["nodes"][0]["name"] == "node-0" and one.pop("connection_reason") == ""  # how to reach it
    assert one.pop("last_test", None) is None  # the NCCL test last run on it
    assert one.pop("encryption")["ray"] == {"token": True, "tls": True}  # the encryption card's word (clusters/encryption.py)
    assert {k: v for k, v in one.items() if k != "members"} == {k: v for k, v in listed.items() if k != "members"}
    assert [{k: v for k, v in m.items() if k != "last_status"} for m in one["members"]] == listed["members"]
    head = listed["members"][0]
    assert (head["name"], head["image_bytes_done"], head["image_source"]) == ("gpu-a", 512, "the server")
    assert head["transfers"][0]["bytes_total"] == 1024


# -- stop -------------------------------------------------------------------------------------------


def test_stopping_a_running_cluster_is_a_202_with_the_cluster_stopping_and_the_job(post, room, queued):
    response = post(f"/api/clusters/{room.pk}/stop/")

    assert response.status_code == 202
    body = response.json()
    assert body["id"] == room.pk and body["state"] == "stopping"
    job = Job.objects.get(pk=body["job"])
    assert (job.kind, job.target_type, job.target_id) == ("cluster.stop", "cluster", room.pk)
    assert queued == [("cluster_job", job.pk)]


def test_stopping_a_stopped_cluster_is_a_400_that_says_there_is_nothing_to_stop(post, stopped_room, queued):
    before = snapshot(stopped_room)

    response = post(f"/api/clusters/{stopped_room.pk}/stop/")

    refused(response, stopped_room, before, queued, "gpu-room is Stopped: there is nothing to stop.")
    assert response.json()["message"] == "gpu-room is Stopped: there is nothing to stop."


def test_stopping_a_cluster_while_a_stop_runs_on_it_is_a_400_that_names_the_job(post, room, queued):
    JobFactory(kind="cluster.stop", title="Stop gpu-room", target_type="cluster", target_id=room.pk, state=JobState.RUNNING)
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/stop/")

    refused(response, room, before, queued, "gpu-room is busy: Stop gpu-room is running. Stop it once it has finished.")


# -- start ------------------------------------------------------------------------------------------


def test_starting_a_stopped_cluster_is_a_202_with_the_start_job(post, stopped_room, queued):
    response = post(f"/api/clusters/{stopped_room.pk}/start/")

    assert response.status_code == 202
    body = response.json()
    assert body["state"] == "starting"
    assert body["restart_attempt"] == 0
    job = Job.objects.get(pk=body["job"])
    assert (job.kind, job.title) == ("cluster.start", "Restart gpu-room")
    assert {m["state"] for m in body["members"]} == {"pending"}
    assert queued == [("cluster_job", job.pk)]


def test_starting_a_running_cluster_is_a_400_that_says_start_is_for_a_stopped_cluster(post, room, queued):
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/start/")

    refused(response, room, before, queued, "gpu-room is Running: Start is for a stopped cluster.")


# -- try again --------------------------------------------------------------------------------------


def test_trying_a_waiting_cluster_again_is_a_202_with_the_restart_job(post, runtime, queued):
    cluster = cluster_of([gpu_machine("gpu-a", 11)], runtime=runtime, state=ClusterState.WAITING)

    response = post(f"/api/clusters/{cluster.pk}/retry/")

    assert response.status_code == 202
    body = response.json()
    assert body["state"] == "starting"
    assert Job.objects.get(pk=body["job"]).kind == "cluster.start"
    assert queued == [("cluster_job", body["job"])]


def test_trying_a_running_cluster_again_is_a_400_that_says_there_is_nothing_to_try_again(post, room, queued):
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/retry/")

    refused(response, room, before, queued, "gpu-room is Running: there is nothing to try again.")


# -- check now --------------------------------------------------------------------------------------


def test_checking_a_running_cluster_now_is_a_202_that_queues_a_manual_check(post, room, queued):
    response = post(f"/api/clusters/{room.pk}/check/")

    assert response.status_code == 202
    assert response.json() == {"queued": True}
    assert queued == [("cluster_check", room.pk, CheckTrigger.MANUAL, "by admin")]


def test_checking_a_stopped_cluster_is_a_400_that_says_checks_look_at_running_clusters(post, stopped_room, queued):
    before = snapshot(stopped_room)

    response = post(f"/api/clusters/{stopped_room.pk}/check/")

    refused(response, stopped_room, before, queued, "gpu-room is Stopped: checks look at a running cluster.")


# -- switch the runtime -----------------------------------------------------------------------------


def test_switching_a_running_cluster_to_a_newer_runtime_restarts_it_on_that_build(post, room, queued):
    newer = build("2.2.0")

    response = post(f"/api/clusters/{room.pk}/switch-runtime/")

    assert response.status_code == 202
    body = response.json()
    assert body["state"] == "starting"
    assert {m["runtime_image"] for m in body["members"]} == {newer.digest}
    job = Job.objects.get(pk=body["job"])
    assert (job.kind, job.params) == ("cluster.start", {"restart": True})
    assert "Switching the runtime" in body["state_reason"]
    assert queued == [("cluster_job", job.pk)]


def test_switching_a_stopped_cluster_records_the_new_build_without_a_job(post, stopped_room, queued):
    newer = build("2.2.0")

    response = post(f"/api/clusters/{stopped_room.pk}/switch-runtime/")

    assert response.status_code == 200
    body = response.json()
    assert body["state"] == "stopped" and body["job"] is None
    assert set(ClusterMember.objects.filter(cluster=stopped_room).values_list("runtime_image", flat=True)) == {newer.pk}
    assert not Job.objects.exists()
    assert queued == []


def test_switching_a_cluster_that_runs_the_newest_build_is_a_400_that_says_so(post, room, queued):
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/switch-runtime/")

    refused(response, room, before, queued, "gpu-room already runs the newest certified runtime for its machines.")


# -- change the network -----------------------------------------------------------------------------


def test_changing_a_running_clusters_network_restarts_it_on_the_new_addresses(post, room, queued):
    response = post(f"/api/clusters/{room.pk}/change-network/", {"network": MANAGEMENT})

    assert response.status_code == 202
    body = response.json()
    assert body["network"] == MANAGEMENT and body["state"] == "starting"
    assert sorted(m["address"] for m in body["members"]) == ["198.18.0.11", "198.18.0.12"]
    assert f"Moving from {NETWORK} to {MANAGEMENT}" in body["state_reason"]
    assert queued == [("cluster_job", body["job"])]


def test_changing_a_stopped_clusters_network_records_it_without_a_job(post, stopped_room, queued):
    response = post(f"/api/clusters/{stopped_room.pk}/change-network/", {"network": MANAGEMENT})

    assert response.status_code == 200
    body = response.json()
    assert (body["network"], body["state"], body["job"]) == (MANAGEMENT, "stopped", None)
    assert not Job.objects.exists()
    assert queued == []


def test_changing_to_a_network_the_machines_do_not_share_is_a_400_naming_the_ones_they_do(post, room, queued):
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/change-network/", {"network": "198.18.7.0/24"})

    refused(response, room, before, queued, "network: 198.18.7.0/24 is not a network all of gpu-room's machines share")
    assert f"pick one of {MANAGEMENT}, {NETWORK}." in response.json()["message"]
    assert response.json()["errors"]["network"]


def test_changing_to_the_network_the_cluster_runs_on_is_a_400_that_says_so(post, room, queued):
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/change-network/", {"network": NETWORK})

    refused(response, room, before, queued, f"network: gpu-room already runs on {NETWORK}.")


def test_changing_the_network_without_one_is_a_400(post, room, queued):
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/change-network/", {})

    refused(response, room, before, queued, "network: This field is required.")


# -- add machines -----------------------------------------------------------------------------------


def test_adding_a_machine_to_a_running_cluster_is_a_202_with_the_add_job(post, room, queued):
    newcomer = gpu_machine("gpu-c", 13)

    response = post(f"/api/clusters/{room.pk}/machines/", {"machines": [newcomer.pk]})

    assert response.status_code == 202
    body = response.json()
    added = next(m for m in body["members"] if m["machine"] == newcomer.pk)
    assert (added["role"], added["address"], added["state"]) == ("worker", "198.18.1.13", "pending")
    job = Job.objects.get(pk=body["job"])
    assert (job.kind, job.title) == ("cluster.add", "Add gpu-c to gpu-room")
    assert job.params == {"members": [ClusterMember.objects.get(machine=newcomer).pk]}
    assert queued == [("cluster_job", job.pk)]


def test_adding_machines_to_a_stopped_cluster_is_a_400_that_says_they_join_a_running_one(post, stopped_room, queued):
    newcomer = gpu_machine("gpu-c", 13)
    before = snapshot(stopped_room)

    response = post(f"/api/clusters/{stopped_room.pk}/machines/", {"machines": [newcomer.pk]})

    refused(response, stopped_room, before, queued, "Machines join a running cluster; gpu-room is Stopped.")


def test_adding_a_machine_without_an_address_on_the_clusters_network_is_a_400_that_says_so(post, room, queued):
    newcomer = gpu_machine("gpu-c", 13, cluster_network=False)
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/machines/", {"machines": [newcomer.pk]})

    refused(response, room, before, queued, f"machines: gpu-c has no address on the cluster's network {NETWORK}.")


def test_adding_a_machine_of_another_cluster_is_a_400_naming_that_cluster(post, room, runtime, queued):
    other = gpu_machine("gpu-c", 13)
    cluster_of([other], name="serve-1", runtime=runtime)
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/machines/", {"machines": [other.pk]})

    refused(response, room, before, queued, "serve-1")
    assert response.json()["message"].startswith("machines: ")


def test_adding_an_offline_machine_is_a_400_naming_its_state(post, room, queued):
    newcomer = gpu_machine("gpu-c", 13, state=MachineState.OFFLINE)
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/machines/", {"machines": [newcomer.pk]})

    refused(response, room, before, queued, "gpu-c")
    assert "Offline" in response.json()["message"]


def test_adding_a_machine_already_in_the_cluster_is_a_400_that_says_so(post, room, queued):
    before = snapshot(room)
    member = room.members.get(role=Role.WORKER).machine

    response = post(f"/api/clusters/{room.pk}/machines/", {"machines": [member.pk]})

    refused(response, room, before, queued, f"machines: {member.name} already belongs to gpu-room.")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"machines": []}, "machines: Tick at least one machine to add."),
        ({"machines": [999999]}, "machines: No machine has the id 999999."),
        ({}, "machines: This field is required."),
        ({"machines": ["gpu-c"]}, "machines: "),
    ],
)
def test_adding_no_machine_or_an_unknown_one_is_a_400(post, room, queued, body, words):
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/machines/", body)

    refused(response, room, before, queued, words)


# -- remove a machine -------------------------------------------------------------------------------


def test_removing_a_worker_from_a_stopped_cluster_leaves_the_machine_enrolled(post, stopped_room, queued):
    worker = stopped_room.members.get(role=Role.WORKER).machine

    response = post(f"/api/clusters/{stopped_room.pk}/machines/{worker.pk}/", method="delete")

    assert response.status_code == 202
    body = response.json()
    assert [m["name"] for m in body["members"]] == ["gpu-a"]
    assert body["job"] is not None  # the cluster's settings leave the machine, the others get a new node key
    assert Machine.objects.filter(pk=worker.pk).exists()
    assert not ClusterMember.objects.filter(machine=worker).exists()
    assert [name for name, *_ in queued] == ["cluster_job"]


def test_removing_the_head_of_a_stopped_cluster_makes_the_machine_with_the_most_accelerators_lead(post, runtime, queued):
    head, small, big = gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12), gpu_machine("gpu-c", 13)
    AcceleratorFactory.create_batch(2, machine=big)
    cluster = cluster_of([head, small, big], runtime=runtime, state=ClusterState.STOPPED)

    response = post(f"/api/clusters/{cluster.pk}/machines/{head.pk}/", method="delete")

    assert response.status_code == 202
    assert response.json()["head"] == big.pk
    assert ClusterMember.objects.get(machine=big).role == Role.HEAD


def test_removing_a_machine_from_a_running_cluster_is_a_400_that_points_to_its_drain(post, room, queued):
    worker = room.members.get(role=Role.WORKER).machine
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/machines/{worker.pk}/", method="delete")

    refused(response, room, before, queued, f"a machine that joined leaves a running cluster by a drain first. Remove from "
                                            f"cluster shows {worker.name}'s drain plan before anything moves.")


def test_removing_the_head_from_a_running_cluster_is_a_400_that_says_stop_it_first(post, room, queued):
    head = room.members.get(role=Role.HEAD).machine
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/machines/{head.pk}/", method="delete")

    refused(response, room, before, queued, f"{head.name} leads gpu-room: to take out the head, stop the cluster first.")


def test_removing_a_machine_that_is_not_in_the_cluster_is_a_400(post, stopped_room, queued):
    outsider = gpu_machine("gpu-c", 13)
    before = snapshot(stopped_room)

    response = post(f"/api/clusters/{stopped_room.pk}/machines/{outsider.pk}/", method="delete")

    refused(response, stopped_room, before, queued, "That machine is not in gpu-room.")


def test_removing_the_only_machine_of_a_cluster_is_a_400_that_says_delete_it_instead(post, runtime, queued):
    only = gpu_machine("gpu-a", 11)
    cluster = cluster_of([only], runtime=runtime, state=ClusterState.STOPPED)
    before = snapshot(cluster)

    response = post(f"/api/clusters/{cluster.pk}/machines/{only.pk}/", method="delete")

    refused(response, cluster, before, queued, "gpu-a is the only machine of gpu-room: delete the cluster instead.")


# -- delete -----------------------------------------------------------------------------------------


def test_deleting_a_stopped_cluster_whose_machines_are_offline_is_a_204_that_leaves_its_machines(post, stopped_room, queued):
    machine_ids = set(stopped_room.members.values_list("machine_id", flat=True))
    Machine.objects.update(state=MachineState.OFFLINE)

    response = post(f"/api/clusters/{stopped_room.pk}/", method="delete")

    assert response.status_code == 204
    assert not Cluster.objects.filter(pk=stopped_room.pk).exists()
    assert not ClusterMember.objects.exists()
    assert set(Machine.objects.values_list("pk", flat=True)) == machine_ids
    assert queued == []


def test_deleting_a_stopped_cluster_whose_machines_answer_is_a_202_with_the_delete_job(post, stopped_room, queued):
    response = post(f"/api/clusters/{stopped_room.pk}/", method="delete")

    assert response.status_code == 202
    job = Job.objects.get(pk=response.json()["job"])
    assert job.kind == "cluster.delete" and queued == [("cluster_job", job.pk)]


def test_deleting_a_running_cluster_stops_it_first_and_answers_202_with_the_job(post, room, queued):
    response = post(f"/api/clusters/{room.pk}/", method="delete")

    assert response.status_code == 202
    body = response.json()
    assert body["state"] == "deleting"
    job = Job.objects.get(pk=body["job"])
    assert (job.kind, job.title) == ("cluster.delete", "Delete gpu-room")
    assert Cluster.objects.filter(pk=room.pk).exists()
    assert queued == [("cluster_job", job.pk)]


def test_deleting_a_running_cluster_whose_machines_are_all_offline_goes_at_once(post, room, queued):
    Machine.objects.update(state=MachineState.OFFLINE)

    response = post(f"/api/clusters/{room.pk}/", method="delete")

    assert response.status_code == 204
    assert not Cluster.objects.exists()
    assert Machine.objects.count() == 2


def test_deleting_a_cluster_with_a_deployment_is_a_400_and_keeps_everything(post, room, queued):
    deployment_of(room)
    before = snapshot(room)

    response = post(f"/api/clusters/{room.pk}/", method="delete")

    refused(response, room, before, queued,
            "gpu-room still has 1 deployment: delete them first, so that no model is left running on the machines.")
    assert Deployment.objects.filter(cluster=room).exists()


def test_deleting_a_cluster_that_is_being_deleted_is_a_400_that_says_so(post, runtime, queued):
    cluster = cluster_of([gpu_machine("gpu-a", 11)], runtime=runtime, state=ClusterState.DELETING)
    before = snapshot(cluster)

    response = post(f"/api/clusters/{cluster.pk}/", method="delete")

    refused(response, cluster, before, queued, "gpu-room is already being deleted.")


# -- health checks ----------------------------------------------------------------------------------


def test_health_checks_list_newest_first_with_what_they_looked_at_found_and_did(api_client, room):
    now = timezone.now()
    older = HealthCheck.objects.create(cluster=room, trigger=CheckTrigger.SCHEDULE, outcome=CheckOutcome.HEALTHY,
                                       looked_at=["Ray on the head gpu-a"], action="Nothing to do.", finished_at=now)
    newer = HealthCheck.objects.create(
        cluster=room, trigger=CheckTrigger.MANUAL, trigger_detail="by admin", outcome=CheckOutcome.LOOK_AGAIN,
        looked_at=["Ray on the head gpu-a", "the agent of gpu-b"],
        found=[{"machine": "gpu-b", "problem": "out_of_ray", "text": "Ray is not running on gpu-b."}],
        action="Looking again in 20 s before joining gpu-b again.",
    )
    HealthCheck.objects.filter(pk=older.pk).update(started_at=now - timedelta(minutes=2))
    HealthCheck.objects.filter(pk=newer.pk).update(started_at=now - timedelta(minutes=1))
    elsewhere = HealthCheck.objects.create(cluster=Cluster.objects.create(name="other"), trigger=CheckTrigger.SCHEDULE)

    body = api_client.get(f"/api/clusters/{room.pk}/health-checks/").json()

    assert body["count"] == 2
    assert [c["id"] for c in body["results"]] == [newer.pk, older.pk]
    assert elsewhere.pk not in [c["id"] for c in body["results"]]
    first = body["results"][0]
    assert set(first) == {"id", "trigger", "trigger_detail", "outcome", "looked_at", "found", "action", "started_at", "finished_at"}
    assert (first["trigger"], first["trigger_detail"], first["outcome"]) == ("manual", "by admin", "look_again")
    assert first["found"] == [{"machine": "gpu-b", "problem": "out_of_ray", "text": "Ray is not running on gpu-b."}]
    assert first["finished_at"] is None
    assert body["results"][1]["finished_at"] is not None


def test_health_checks_are_paginated(api_client, room):
    HealthCheck.objects.bulk_create(HealthCheck(cluster=room, trigger=CheckTrigger.SCHEDULE) for _ in range(51))

    first = api_client.get(f"/api/clusters/{room.pk}/health-checks/").json()

    assert first["count"] == 51 and len(first["results"]) == 50
    assert "page=2" in first["next"]


# -- who may join -----------------------------------------------------------------------------------


def test_join_candidates_list_every_machine_outside_the_cluster_with_whether_it_may_join(api_client, room, runtime):
    ready = gpu_machine("gpu-c", 13)
    elsewhere = gpu_machine("gpu-d", 14, cluster_network=False)
    offline = gpu_machine("gpu-e", 15, state=MachineState.OFFLINE)

    body = api_client.get(f"/api/clusters/{room.pk}/join-candidates/").json()
    rows = {row["name"]: row for row in body["results"]}

    assert (body["count"], body["page"], body["pages"]) == (3, 1, 1)
    assert set(rows) == {"gpu-c", "gpu-d", "gpu-e"}
    assert rows["gpu-c"] == {
        "machine": ready.pk, "name": "gpu-c", "state": "healthy", "arch": "x86_64", "accelerators": 8,
        "accelerator_model": "NVIDIA H100 80GB HBM3", "cluster": None, "address": "198.18.1.13",
        "selectable": True, "refusal": "", "warning": "", "runtime": rows["gpu-c"]["runtime"],
    }
    assert "Runtime 2.x" in rows["gpu-c"]["runtime"]
    assert rows["gpu-d"]["machine"] == elsewhere.pk and rows["gpu-d"]["address"] is None
    assert rows["gpu-d"]["refusal"] == f"gpu-d has no address on the cluster's network {NETWORK}."
    assert rows["gpu-e"]["machine"] == offline.pk and not rows["gpu-e"]["selectable"]


def test_join_candidates_come_a_page_at_a_time_and_filter_by_name_kind_and_state(api_client, room, runtime):
    for host in range(20, 75):
        gpu_machine(f"spare-{host}", host)
    gpu_machine("gpu-down", 76, state=MachineState.OFFLINE)
    url = f"/api/clusters/{room.pk}/join-candidates/"

    first, second = api_client.get(url).json(), api_client.get(url + "?page=2").json()
    assert (first["count"], first["pages"], len(first["results"]), len(second["results"])) == (56, 2, 50, 6)
    assert not {r["name"] for r in first["results"]} & {r["name"] for r in second["results"]}
    assert [r["name"] for r in api_client.get(url + "?q=spare-7").json()["results"]] == [f"spare-7{i}" for i in range(5)]
    assert [r["name"] for r in api_client.get(url + "?state=offline").json()["results"]] == ["gpu-down"]
    assert api_client.get(url + "?kind=amd/x86_64").json()["count"] == 0
    assert api_client.get(url + "?kind=nvidia/x86_64&state=available").json()["count"] == 55
    not_ascii = api_client.get(url + "?page=٣")  # Arabic-Indic three: refused, not read as 3, nor a 500
    assert not_ascii.status_code == 400 and not_ascii.json()["message"].startswith("page: Give a whole number")


# -- the schema -------------------------------------------------------------------------------------


def test_the_openapi_schema_describes_the_cluster_actions(api_client):
    response = api_client.get("/api/schema/")

    assert response.status_code == 200
    text = response.content.decode()
    for path in ["{id}/", "{id}/stop/", "{id}/start/", "{id}/check/", "{id}/retry/", "{id}/switch-runtime/",
                 "{id}/change-network/", "{id}/machines/", "{id}/machines/{machine_id}/", "{id}/health-checks/",
                 "{id}/join-candidates/"]:
        assert f"/api/clusters/{path}:" in text
    assert "ClusterStateEnum" in text  # the cluster's states are described once, under their own name
