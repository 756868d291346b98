"""A cluster's life once it exists, short of the machines: stop, start, delete, grow and shrink, failed
restarts and their retries, reconnects, runtime and network switches, and health checks with the
agents' answers made up. Tasks are only enqueued (recorded here); nothing reaches a machine."""
from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from clusters import actions, health, services, steps
from tests.fakes import FakeAgents
from clusters.choices import CheckOutcome, CheckTrigger, ClusterState, MemberState, Role
from clusters.models import Cluster, ClusterMember, HealthCheck
from console import live, roles
from console.choices import JobState
from console.models import Job
from machines.choices import MachineState
from machines.models import Machine
from tests.builders import NETWORK, build, cluster_of, deployment_of, gpu_machine
from tests.factories import JobFactory, NetworkInterfaceFactory

pytestmark = pytest.mark.django_db

MANAGEMENT = "198.18.0.0/24"  # the other network every machine below shares
GCS = "198.18.1.11:6379"  # gpu-a leads every cluster below


@pytest.fixture
def runtime():
    return build("2.1.0")


@pytest.fixture
def gpu_a():
    return gpu_machine("gpu-a", 11)


@pytest.fixture
def gpu_b():
    return gpu_machine("gpu-b", 12)


@pytest.fixture
def room(runtime, gpu_a, gpu_b):
    """gpu-room: gpu-a leads, gpu-b works, running on 198.18.1.0/24."""
    return cluster_of([gpu_a, gpu_b], runtime=runtime)


@pytest.fixture
def stopped_room(runtime, gpu_a, gpu_b):
    return cluster_of([gpu_a, gpu_b], runtime=runtime, state=ClusterState.STOPPED)


@pytest.fixture(autouse=True)
def no_pushes(monkeypatch):
    """Pushes are hints to the pages; these tests read the database."""
    monkeypatch.setattr(live, "push", lambda *args, **kwargs: None)


@pytest.fixture
def committed(queued, django_capture_on_commit_callbacks):
    """Call a service and run what it left for after commit (the enqueueing of its tasks)."""

    def call(service, **kwargs):
        with django_capture_on_commit_callbacks(execute=True):
            return service(**kwargs)

    return call


def refused(committed, service, **kwargs) -> str:
    with pytest.raises(ValidationError) as refusal:
        committed(service, **kwargs)
    return " ".join(refusal.value.messages)


def fresh(cluster: Cluster) -> Cluster:
    return Cluster.objects.get(pk=cluster.pk)


def jobs_of(cluster: Cluster) -> list[Job]:
    return list(Job.objects.filter(target_type="cluster", target_id=cluster.pk).order_by("pk"))


def member_of(machine: Machine) -> ClusterMember:
    return ClusterMember.objects.get(machine=machine)


def about(moment, seconds: float, before, after) -> bool:
    return before + timedelta(seconds=seconds) <= moment <= after + timedelta(seconds=seconds)


# -- stop ---------------------------------------------------------------------------------------


def test_stop_moves_a_running_cluster_to_stopping_and_writes_one_stop_job(committed, queued, room):
    Cluster.objects.filter(pk=room.pk).update(restart_attempt=2, next_retry_at=timezone.now())

    job = committed(services.cluster_stop, cluster=room)

    cluster = fresh(room)
    assert cluster.state == ClusterState.STOPPING
    assert cluster.state_reason == "Stopping Ray and the runtime on every machine."
    assert (cluster.restart_attempt, cluster.next_retry_at) == (0, None)
    assert jobs_of(room) == [job]
    assert (job.kind, job.title, job.state) == (steps.STOP.kind, "Stop gpu-room", JobState.QUEUED)
    assert [s["name"] for s in job.steps] == steps.STOP.step_names
    assert queued == [("cluster_job", job.pk)]


def test_stop_is_refused_on_a_stopped_cluster(committed, queued, stopped_room):
    words = refused(committed, services.cluster_stop, cluster=stopped_room)

    assert words == "gpu-room is Stopped: there is nothing to stop."
    assert fresh(stopped_room).state == ClusterState.STOPPED
    assert jobs_of(stopped_room) == [] and queued == []


def test_stop_is_refused_while_another_stop_runs_on_the_cluster_and_names_it(committed, queued, room):
    JobFactory(kind=steps.STOP.kind, title="Stop gpu-room", target_type="cluster", target_id=room.pk,
               state=JobState.RUNNING)

    words = refused(committed, services.cluster_stop, cluster=room)

    assert words == "gpu-room is busy: Stop gpu-room is running. Stop it once it has finished."
    assert fresh(room).state == ClusterState.RUNNING
    assert len(jobs_of(room)) == 1 and queued == []


def test_machines_that_did_not_confirm_a_stop_leave_the_cluster_waiting_for_a_person_to_stop_or_delete_again(room):
    Cluster.objects.filter(pk=room.pk).update(state=ClusterState.STOPPING)

    message = services.cluster_stop_unconfirmed(cluster=fresh(room), failures=["gpu-b did not answer (timed out)."])

    cluster = fresh(room)
    assert cluster.state == ClusterState.UNCONFIRMED
    assert cluster.state_reason == message
    assert message.startswith("The machines did not confirm the cluster stopped. gpu-b did not answer (timed out).")
    offers = actions.cluster_actions(cluster, None, role=roles.OPERATOR)
    assert offers["stop"].ok and offers["delete"].ok
    assert not offers["start"].ok and not offers["retry"].ok
    assert actions.page_flags(cluster) == {"show_start": False, "show_retry": False, "show_check": False, "stop_again": True}


# -- start and try again -----------------------------------------------------------------------------


@pytest.mark.parametrize("state", sorted(set(ClusterState) - {ClusterState.STOPPED}))
def test_start_is_refused_on_a_cluster_that_is_not_stopped(committed, queued, runtime, gpu_a, gpu_b, state):
    cluster = cluster_of([gpu_a, gpu_b], runtime=runtime, state=state)

    words = refused(committed, services.cluster_start, cluster=cluster)

    assert words == f"gpu-room is {ClusterState(state).label}: Start is for a stopped cluster."
    assert fresh(cluster).state == state
    assert jobs_of(cluster) == [] and queued == []


def test_start_of_a_stopped_cluster_writes_a_restart_job_and_reads_starting(committed, queued, stopped_room):
    Cluster.objects.filter(pk=stopped_room.pk).update(restart_attempt=3, start_attempts=4)

    job = committed(services.cluster_start, cluster=stopped_room)

    cluster = fresh(stopped_room)
    assert cluster.state == ClusterState.STARTING
    assert (cluster.restart_attempt, cluster.start_attempts) == (0, 1)
    assert (job.kind, job.params) == (steps.START.kind, {"restart": True})
    assert [s["name"] for s in job.steps] == [steps.STOP_RAY.name, *steps.START.step_names]
    assert set(stopped_room.members.values_list("state", flat=True)) == {MemberState.PENDING}
    assert queued == [("cluster_job", job.pk)]


def test_try_again_from_failed_starts_over_at_once_from_the_first_restart(committed, queued, runtime, gpu_a, gpu_b):
    cluster = cluster_of([gpu_a, gpu_b], runtime=runtime, state=ClusterState.FAILED, restart_attempt=3,
                         next_retry_at=timezone.now() + timedelta(minutes=10))

    job = committed(services.cluster_retry, cluster=cluster)

    cluster = fresh(cluster)
    assert cluster.state == ClusterState.STARTING
    assert (cluster.restart_attempt, cluster.next_retry_at) == (0, None)
    assert job.params == {"restart": True}
    assert queued == [("cluster_job", job.pk)]


def test_try_again_is_refused_on_a_running_cluster(committed, queued, room):
    assert refused(committed, services.cluster_retry, cluster=room) == "gpu-room is Running: there is nothing to try again."
    assert jobs_of(room) == []


# -- failed starts and restarts -----------------------------------------------------------------------


def test_a_failed_first_restart_of_a_repair_retries_after_the_restart_pause(settings, runtime, gpu_a, gpu_b):
    settings.FADEN_RESTART_PAUSE, settings.FADEN_RESTART_ATTEMPTS = 45, 3
    cluster = cluster_of([gpu_a, gpu_b], runtime=runtime, state=ClusterState.STARTING, restart_attempt=1)

    before = timezone.now()
    services.cluster_start_failed(cluster=cluster, message="Ray did not start on gpu-a", kind="retryable")
    after = timezone.now()

    cluster = fresh(cluster)
    assert cluster.state == ClusterState.RETRYING
    assert about(cluster.next_retry_at, 45, before, after)
    assert cluster.state_reason == ("Restart 1 of 3 failed: Ray did not start on gpu-a. "
                                    "Restarting the cluster (attempt 2 of 3) in 45 s.")


def test_a_failed_last_restart_of_a_repair_reads_failed_and_is_tried_again_after_the_failed_retry(settings, runtime,
                                                                                                  gpu_a, gpu_b):
    settings.FADEN_FAILED_RETRY, settings.FADEN_RESTART_ATTEMPTS = 900, 3
    cluster = cluster_of([gpu_a, gpu_b], runtime=runtime, state=ClusterState.STARTING, restart_attempt=3)

    before = timezone.now()
    services.cluster_start_failed(cluster=cluster, message="Ray did not start on gpu-a.", kind="retryable")
    after = timezone.now()

    cluster = fresh(cluster)
    assert cluster.state == ClusterState.FAILED
    assert about(cluster.next_retry_at, 900, before, after)
    assert "did not come back after 3 restarts" in cluster.state_reason
    assert "every 15 minutes" in cluster.state_reason and "Try again" in cluster.state_reason


def test_a_failed_start_that_retrying_cannot_change_waits_for_a_person_with_no_retry(runtime, gpu_a, gpu_b):
    cluster = cluster_of([gpu_a, gpu_b], runtime=runtime, state=ClusterState.STARTING, restart_attempt=1)

    services.cluster_start_failed(cluster=cluster, message="gpu-a has no agent yet: refresh its facts", kind="not_retryable")

    cluster = fresh(cluster)
    assert cluster.state == ClusterState.WAITING
    assert cluster.state_reason.startswith("This will not change by retrying: gpu-a has no agent yet: refresh its facts.")
    assert cluster.next_retry_at is None


def test_a_failed_cluster_whose_time_came_is_restarted(committed, queued, settings, runtime, gpu_a, gpu_b):
    settings.FADEN_FAILED_RETRY, settings.FADEN_RESTART_ATTEMPTS = 900, 3
    cluster = cluster_of([gpu_a, gpu_b], runtime=runtime, state=ClusterState.FAILED, restart_attempt=3,
                         next_retry_at=timezone.now() - timedelta(seconds=1))

    assert committed(services.clusters_retry_due) == [cluster.pk]

    cluster = fresh(cluster)
    assert cluster.state == ClusterState.STARTING
    assert cluster.state_reason == "Trying again, as every 15 minutes after 3 failed restarts."
    assert cluster.next_retry_at is None
    (job,) = jobs_of(cluster)
    assert (job.kind, job.params) == (steps.START.kind, {"restart": True})
    assert queued == [("cluster_job", job.pk)]


def test_a_retrying_repair_whose_pause_is_over_makes_its_next_restart(committed, queued, runtime, gpu_a, gpu_b):
    cluster = cluster_of([gpu_a, gpu_b], runtime=runtime, state=ClusterState.RETRYING, restart_attempt=1,
                         next_retry_at=timezone.now() - timedelta(seconds=1))

    assert committed(services.clusters_retry_due) == [cluster.pk]

    cluster = fresh(cluster)
    assert (cluster.state, cluster.restart_attempt) == (ClusterState.STARTING, 2)
    assert cluster.state_reason == "Restarting the cluster (attempt 2 of 3)."
    (job,) = jobs_of(cluster)
    assert job.params == {"restart": True}


def test_a_retrying_first_start_is_started_again_without_a_restart(committed, queued, runtime, gpu_a, gpu_b):
    cluster = cluster_of([gpu_a, gpu_b], runtime=runtime, state=ClusterState.RETRYING, start_attempts=2,
                         next_retry_at=timezone.now() - timedelta(seconds=1))

    assert committed(services.clusters_retry_due) == [cluster.pk]

    (job,) = jobs_of(cluster)
    assert (job.title, job.params) == ("Start gpu-room", {"restart": False})
    assert fresh(cluster).start_attempts == 3


def test_clusters_whose_pause_is_not_over_or_that_are_busy_are_left_alone(committed, queued, runtime):
    later = cluster_of([gpu_machine("gpu-a", 11)], name="later", runtime=runtime, state=ClusterState.FAILED,
                       restart_attempt=3, next_retry_at=timezone.now() + timedelta(minutes=5))
    busy = cluster_of([gpu_machine("gpu-b", 12)], name="busy", runtime=runtime, state=ClusterState.RETRYING,
                      restart_attempt=1, next_retry_at=timezone.now() - timedelta(seconds=1))
    running = cluster_of([gpu_machine("gpu-c", 13)], name="running", runtime=runtime,
                         next_retry_at=timezone.now() - timedelta(seconds=1))
    JobFactory(kind=steps.STOP.kind, title="Stop busy", target_type="cluster", target_id=busy.pk)

    assert committed(services.clusters_retry_due) == []

    assert [fresh(c).state for c in (later, busy, running)] == [ClusterState.FAILED, ClusterState.RETRYING, ClusterState.RUNNING]
    assert fresh(busy).restart_attempt == 1
    assert queued == []


# -- delete --------------------------------------------------------------------------------------------


def test_delete_is_refused_while_the_cluster_has_a_deployment(committed, queued, room):
    deployment_of(room)

    words = refused(committed, services.cluster_delete, cluster=room)

    assert words.startswith("gpu-room still has 1 deployment: delete them first")
    assert fresh(room).state == ClusterState.RUNNING
    assert jobs_of(room) == [] and queued == []


def test_delete_of_a_stopped_cluster_is_a_job_that_takes_the_node_settings_off_its_machines(committed, queued, stopped_room):
    job = committed(services.cluster_delete, cluster=stopped_room)

    cluster = fresh(stopped_room)
    assert cluster.state == ClusterState.DELETING
    assert cluster.state_reason == "Taking the node settings off the machines that answer, then deleting the cluster."
    assert (job.kind, [s["name"] for s in job.steps]) == (steps.DELETE.kind, steps.DELETE.step_names)
    assert queued == [("cluster_job", job.pk)]


def test_delete_of_a_stopped_cluster_whose_machines_are_all_offline_goes_at_once_and_leaves_them_enrolled(
        committed, queued, stopped_room, gpu_a, gpu_b):
    Machine.objects.update(state=MachineState.OFFLINE, state_reason="No heartbeat for 30 s.")

    assert committed(services.cluster_delete, cluster=stopped_room) is None

    assert not Cluster.objects.filter(pk=stopped_room.pk).exists()
    assert not ClusterMember.objects.exists()
    for machine in (gpu_a, gpu_b):
        assert not hasattr(Machine.objects.get(pk=machine.pk), "membership")
    assert Job.objects.count() == 0 and queued == []


def test_delete_of_a_running_cluster_whose_machines_are_all_offline_goes_at_once(committed, queued, room):
    Machine.objects.update(state=MachineState.OFFLINE, state_reason="No heartbeat for 30 s.")

    assert committed(services.cluster_delete, cluster=room) is None

    assert not Cluster.objects.exists()
    assert Machine.objects.count() == 2
    assert queued == []


def test_delete_of_a_running_cluster_stops_it_first_in_a_delete_job(committed, queued, room, gpu_b):
    Machine.objects.filter(pk=gpu_b.pk).update(state=MachineState.OFFLINE)  # one that answers is enough

    job = committed(services.cluster_delete, cluster=room)

    cluster = fresh(room)
    assert cluster.state == ClusterState.DELETING
    assert (job.kind, [s["name"] for s in job.steps]) == (steps.DELETE.kind, steps.DELETE.step_names)
    assert queued == [("cluster_job", job.pk)]


def test_delete_is_refused_while_the_cluster_is_already_being_deleted(committed, queued, runtime, gpu_a):
    cluster = cluster_of([gpu_a], runtime=runtime, state=ClusterState.DELETING)

    assert refused(committed, services.cluster_delete, cluster=cluster) == "gpu-room is already being deleted."
    assert Cluster.objects.filter(pk=cluster.pk).exists()


# -- add machines --------------------------------------------------------------------------------------


def test_machines_are_refused_by_a_cluster_that_is_not_running(committed, queued, stopped_room):
    gpu_c = gpu_machine("gpu-c", 13)

    words = refused(committed, services.cluster_add_machines, cluster=stopped_room, machine_ids=[gpu_c.pk])

    assert words == "Machines join a running cluster; gpu-room is Stopped."
    assert not ClusterMember.objects.filter(machine=gpu_c).exists()


def test_a_machine_in_another_cluster_or_off_the_cluster_network_is_refused_in_words(committed, queued, room, runtime):
    taken = gpu_machine("gpu-c", 13)
    cluster_of([taken], name="other-room", runtime=runtime)
    off_network = gpu_machine("gpu-d", 14, cluster_network=False)

    with pytest.raises(ValidationError) as refusal:
        committed(services.cluster_add_machines, cluster=room, machine_ids=[taken.pk, off_network.pk])

    assert refusal.value.message_dict["machines"] == [
        "gpu-c is in the cluster other-room: take it out of that cluster before you pick it.",
        "gpu-d has no address on the cluster's network 198.18.1.0/24.",
    ]
    assert room.members.count() == 2
    assert jobs_of(room) == [] and queued == []


def test_a_machine_already_in_the_cluster_is_refused(committed, queued, room, gpu_b):
    words = refused(committed, services.cluster_add_machines, cluster=room, machine_ids=[gpu_b.pk])

    assert words == "gpu-b already belongs to gpu-room."


def test_added_machines_join_with_their_address_on_the_cluster_network_in_an_add_job(committed, queued, room, runtime):
    gpu_c, gpu_d = gpu_machine("gpu-c", 13), gpu_machine("gpu-d", 14)

    job = committed(services.cluster_add_machines, cluster=room, machine_ids=[gpu_c.pk, gpu_d.pk])

    c, d = member_of(gpu_c), member_of(gpu_d)
    assert (c.cluster_id, c.role, c.address, c.runtime_image_id) == (room.pk, Role.WORKER, "198.18.1.13", runtime.pk)
    assert (d.address, d.state) == ("198.18.1.14", MemberState.PENDING)
    assert (job.kind, job.title, job.params) == (steps.ADD.kind, "Add gpu-c, gpu-d to gpu-room", {"members": [c.pk, d.pk]})
    assert fresh(room).state == ClusterState.RUNNING
    assert queued == [("cluster_job", job.pk)]


def test_a_machine_added_to_a_running_cluster_gets_the_build_the_cluster_runs_not_a_newer_one(committed, queued, room,
                                                                                              runtime):
    newer = build("2.2.0")
    gpu_c = gpu_machine("gpu-c", 13)

    committed(services.cluster_add_machines, cluster=room, machine_ids=[gpu_c.pk])

    assert member_of(gpu_c).runtime_image_id == runtime.pk != newer.pk


# -- remove machines -----------------------------------------------------------------------------------


def test_the_head_of_a_running_cluster_cannot_be_removed_until_the_cluster_is_stopped(committed, room, gpu_a):
    words = refused(committed, services.cluster_member_remove, cluster=room, machine_id=gpu_a.pk)

    assert words == "gpu-a leads gpu-room: to take out the head, stop the cluster first."
    assert room.members.count() == 2


def test_a_worker_of_a_running_cluster_is_not_removed_from_its_record(committed, room, gpu_b):
    words = refused(committed, services.cluster_member_remove, cluster=room, machine_id=gpu_b.pk)

    assert "leaves a running cluster by a drain first. Remove from cluster shows gpu-b's drain plan" in words
    assert ClusterMember.objects.filter(machine=gpu_b).exists()


def test_a_worker_leaves_a_stopped_cluster_and_stays_enrolled(committed, stopped_room, gpu_a, gpu_b):
    job = committed(services.cluster_member_remove, cluster=stopped_room, machine_id=gpu_b.pk)
    assert job.kind == "cluster.leave" and job.params == {"machine_id": gpu_b.pk, "machine_name": "gpu-b"}

    assert list(stopped_room.members.values_list("machine__name", "role")) == [("gpu-a", Role.HEAD)]
    assert Machine.objects.get(pk=gpu_b.pk).state == MachineState.HEALTHY


def test_when_the_head_leaves_a_stopped_cluster_the_machine_with_the_most_accelerators_leads(committed, runtime):
    head = gpu_machine("gpu-a", 11, accelerators=8)
    few, many = gpu_machine("gpu-b", 12, accelerators=2), gpu_machine("gpu-c", 13, accelerators=4)
    cluster = cluster_of([head, few, many], runtime=runtime, state=ClusterState.STOPPED)

    committed(services.cluster_member_remove, cluster=cluster, machine_id=head.pk)

    assert dict(cluster.members.values_list("machine__name", "role")) == {"gpu-b": Role.WORKER, "gpu-c": Role.HEAD}


def test_a_machine_that_did_not_join_a_running_cluster_can_be_taken_out_of_it(committed, room, gpu_b):
    ClusterMember.objects.filter(machine=gpu_b).update(state=MemberState.FAILED, state_reason="Ray on the head does not list gpu-b.")

    committed(services.cluster_member_remove, cluster=room, machine_id=gpu_b.pk)

    assert list(room.members.values_list("machine__name", flat=True)) == ["gpu-a"]
    assert fresh(room).state == ClusterState.RUNNING


def test_the_last_machine_of_a_cluster_cannot_be_removed(committed, runtime, gpu_a):
    cluster = cluster_of([gpu_a], runtime=runtime, state=ClusterState.STOPPED)

    words = refused(committed, services.cluster_member_remove, cluster=cluster, machine_id=gpu_a.pk)

    assert words == "gpu-a is the only machine of gpu-room: delete the cluster instead."
    assert cluster.members.count() == 1


# -- reconnects ----------------------------------------------------------------------------------------


def test_a_machine_reconnecting_to_a_running_cluster_gets_it_checked(committed, queued, room, gpu_b):
    committed(services.cluster_machine_reconnected, machine_id=gpu_b.pk, name="gpu-b")

    assert queued == [("cluster_check", room.pk, CheckTrigger.RECONNECT, "gpu-b")]
    assert jobs_of(room) == []


def test_a_failed_repaired_cluster_starts_again_once_a_machine_reconnects_and_its_head_is_healthy(committed, queued, runtime,
                                                                                                 gpu_a, gpu_b):
    cluster = cluster_of([gpu_a, gpu_b], runtime=runtime, state=ClusterState.FAILED, restart_attempt=3,
                         next_retry_at=timezone.now() + timedelta(minutes=10))

    committed(services.cluster_machine_reconnected, machine_id=gpu_a.pk, name="gpu-a")

    cluster = fresh(cluster)
    assert cluster.state == ClusterState.STARTING
    assert cluster.state_reason == "gpu-a reconnected: starting the cluster again."
    (job,) = jobs_of(cluster)
    assert job.params == {"restart": True}
    assert queued == [("cluster_job", job.pk)]


def test_a_failed_repaired_cluster_whose_head_is_still_offline_waits_when_a_worker_reconnects(committed, queued, runtime,
                                                                                             gpu_a, gpu_b):
    Machine.objects.filter(pk=gpu_a.pk).update(state=MachineState.OFFLINE)
    cluster = cluster_of([gpu_a, gpu_b], runtime=runtime, state=ClusterState.FAILED, restart_attempt=3)

    committed(services.cluster_machine_reconnected, machine_id=gpu_b.pk, name="gpu-b")

    assert fresh(cluster).state == ClusterState.FAILED
    assert jobs_of(cluster) == [] and queued == []


def test_a_machine_in_no_cluster_reconnecting_changes_nothing(committed, queued, room):
    loner = gpu_machine("gpu-z", 99)

    committed(services.cluster_machine_reconnected, machine_id=loner.pk, name="gpu-z")

    assert queued == [] and Job.objects.count() == 0


# -- runtime and network ----------------------------------------------------------------------------------


def test_switching_the_runtime_is_refused_when_nothing_newer_is_certified(committed, queued, room):
    build("2.2.0", certified=False)

    words = refused(committed, services.cluster_switch_runtime, cluster=room)

    assert words == "gpu-room already runs the newest certified runtime for its machines."
    assert jobs_of(room) == [] and queued == []


def test_switching_the_runtime_moves_every_member_to_the_newer_build_and_restarts_the_cluster(committed, queued, room, runtime):
    newer = build("2.2.0")

    job = committed(services.cluster_switch_runtime, cluster=room)

    assert set(room.members.values_list("runtime_image_id", flat=True)) == {newer.pk}
    cluster = fresh(room)
    assert cluster.state == ClusterState.STARTING
    assert cluster.state_reason == ("Switching the runtime (NVIDIA x86_64 Runtime 2.1.0 to 2.2.0): "
                                    "restarting the cluster on the new build.")
    assert job.params == {"restart": True}
    assert queued == [("cluster_job", job.pk)]


def test_switching_the_runtime_of_a_stopped_cluster_only_records_it(committed, queued, stopped_room):
    newer = build("2.2.0")

    assert committed(services.cluster_switch_runtime, cluster=stopped_room) is None

    assert set(stopped_room.members.values_list("runtime_image_id", flat=True)) == {newer.pk}
    assert fresh(stopped_room).state == ClusterState.STOPPED
    assert jobs_of(stopped_room) == [] and queued == []


def test_a_network_the_machines_do_not_all_share_is_refused(committed, queued, room):
    # Only gpu-a has an address on 198.18.7.0/24.
    NetworkInterfaceFactory(machine=Machine.objects.get(name="gpu-a"), name="eth2", addresses=["198.18.7.11/24"])

    words = refused(committed, services.cluster_change_network, cluster=room, network="198.18.7.0/24")

    assert "198.18.7.0/24 is not a network all of gpu-room's machines share" in words
    assert fresh(room).network == NETWORK
    assert jobs_of(room) == [] and queued == []


def test_moving_a_cluster_to_the_network_it_already_runs_on_is_refused(committed, queued, room):
    words = refused(committed, services.cluster_change_network, cluster=room, network=NETWORK)

    assert words == "gpu-room already runs on 198.18.1.0/24."
    assert jobs_of(room) == []


def test_moving_a_cluster_to_another_shared_network_moves_the_member_addresses_and_restarts_it(committed, queued, room):
    job = committed(services.cluster_change_network, cluster=room, network=MANAGEMENT)

    cluster = fresh(room)
    assert cluster.network == MANAGEMENT
    assert dict(room.members.values_list("machine__name", "address")) == {"gpu-a": "198.18.0.11", "gpu-b": "198.18.0.12"}
    assert cluster.state == ClusterState.STARTING
    assert cluster.state_reason == "Moving from 198.18.1.0/24 to 198.18.0.0/24: restarting the cluster on it."
    assert job.params == {"restart": True}
    assert queued == [("cluster_firewall_refresh", room.pk), ("cluster_job", job.pk)]  # the tables first


# -- health checks -------------------------------------------------------------------------------------------


def agent(machine: Machine, *, ray_running: bool = True) -> dict:
    """What a member's agent answers: its runtime, and whether Ray of this cluster runs there."""
    ray = {"running": True, "role": "worker", "gcs_address": GCS} if ray_running else {"running": False, "gcs_address": None}
    return {"machine": machine.name, "machine_state": machine.state, "runtime": {"state": "running", "ray": ray}}


def node(host: int, *, alive: bool = True) -> dict:
    return {"address": f"198.18.1.{host}", "alive": alive, "gpus": 8, "node_id": f"node-{host}"}


def head_agent(machine: Machine, nodes: list[dict]) -> dict:
    alive = [n for n in nodes if n["alive"]]
    return {**agent(machine), "ray": {"nodes": nodes, "alive_nodes": len(alive), "gpus": 8 * len(alive)}}


def silent(machine: Machine, error: str = "Could not reach 198.18.0.11 port 22: timed out.") -> dict:
    return {"machine": machine.name, "machine_state": machine.state, "error": error}


@pytest.fixture
def answers(monkeypatch):
    """The agents' answers by machine name (their runtime status, Ray on the head, or an error); fill it in a test."""
    return FakeAgents().install(monkeypatch).answers


def all_well(answers, gpu_a, gpu_b):
    answers.update({"gpu-a": head_agent(gpu_a, [node(11), node(12)]), "gpu-b": agent(gpu_b)})


def head_ray_stopped(answers, gpu_a, gpu_b):
    answers.update({"gpu-a": {**agent(gpu_a, ray_running=False), "ray_error": "Ray is not running here."},
                    "gpu-b": agent(gpu_b)})


def check(committed, cluster, *, trigger=CheckTrigger.SCHEDULE, first_look=None, detail=""):
    return committed(health.cluster_check_run, cluster_id=cluster.pk, trigger=trigger, detail=detail,
                     first_look_id=first_look.pk if first_look else None)


def test_a_healthy_check_records_what_it_looked_at_and_does_nothing(committed, queued, answers, room, gpu_a, gpu_b):
    all_well(answers, gpu_a, gpu_b)

    result = check(committed, room)

    recorded = HealthCheck.objects.get()
    assert recorded.pk == result.pk
    assert (recorded.outcome, recorded.found, recorded.trigger) == (CheckOutcome.HEALTHY, [], CheckTrigger.SCHEDULE)
    assert recorded.looked_at == ["Ray on the head gpu-a: 2 live node(s), 16 GPUs",
                                  "The agent on gpu-a: runtime running, Ray running",
                                  "The agent on gpu-b: runtime running, Ray running"]
    assert recorded.action.startswith("Nothing to do")
    assert recorded.finished_at is not None
    cluster = fresh(room)
    assert (cluster.state, cluster.state_reason) == (ClusterState.RUNNING, "")
    assert cluster.last_status_at is not None
    assert member_of(gpu_b).last_status["ray_node"] == node(12)
    assert jobs_of(room) == [] and queued == []


def test_a_problem_on_a_first_look_schedules_a_second_look_and_restarts_nothing(committed, queued, settings, answers, room,
                                                                              gpu_a, gpu_b):
    settings.FADEN_HEALTH_LOOK_AGAIN = 20
    head_ray_stopped(answers, gpu_a, gpu_b)

    first = check(committed, room)

    assert first.outcome == CheckOutcome.LOOK_AGAIN
    assert first.found == [{"machine": "gpu-a", "problem": "head_down", "text": "Ray is not running on the head gpu-a."}]
    assert first.action.startswith("Looking again in 20 s before restarting the cluster")
    assert "Ray on the head gpu-a: no answer (Ray is not running here.)" in first.looked_at
    cluster = fresh(room)
    assert (cluster.state, cluster.restart_attempt) == (ClusterState.RUNNING, 0)
    assert cluster.state_reason == f"Ray is not running on the head gpu-a. {first.action}"
    assert (member_of(gpu_a).state, member_of(gpu_a).state_reason) == (MemberState.DOWN, "Ray is not running on the head gpu-a.")
    assert jobs_of(room) == []
    assert queued == [("cluster_check later", room.pk, CheckTrigger.SECOND_LOOK, "", first.pk, 20)]


def test_a_head_still_down_on_the_second_look_restarts_the_cluster_once_as_attempt_1_of_3(committed, queued, answers, room,
                                                                                       gpu_a, gpu_b):
    head_ray_stopped(answers, gpu_a, gpu_b)
    first = check(committed, room)
    queued.clear()

    second = check(committed, room, trigger=CheckTrigger.SECOND_LOOK, first_look=first)
    again = check(committed, room, trigger=CheckTrigger.SECOND_LOOK, first_look=first)

    assert second.outcome == CheckOutcome.REPAIR
    assert second.first_look_id == first.pk
    assert second.action == "Restarting the cluster (attempt 1 of 3): Ray is not running on the head gpu-a."
    assert again is None  # one repair at a time: the restart is under way
    cluster = fresh(room)
    assert (cluster.state, cluster.restart_attempt) == (ClusterState.STARTING, 1)
    assert cluster.state_reason == second.action
    (job,) = jobs_of(room)
    assert (job.kind, job.params) == (steps.START.kind, {"restart": True})
    assert queued == [("cluster_job", job.pk)]
    assert HealthCheck.objects.count() == 2


def test_a_worker_still_out_of_ray_on_the_second_look_joins_again_while_the_cluster_keeps_running(committed, queued, answers,
                                                                                                 room, gpu_a, gpu_b):
    answers.update({"gpu-a": head_agent(gpu_a, [node(11), node(12, alive=False)]), "gpu-b": agent(gpu_b)})
    first = check(committed, room)
    queued.clear()

    second = check(committed, room, trigger=CheckTrigger.SECOND_LOOK, first_look=first)

    assert first.outcome == CheckOutcome.LOOK_AGAIN
    assert second.outcome == CheckOutcome.REPAIR
    b = member_of(gpu_b)
    assert b.state == MemberState.REJOINING
    (job,) = jobs_of(room)
    assert (job.kind, job.params) == (steps.REJOIN.kind, {"members": [b.pk]})
    assert fresh(room).state == ClusterState.RUNNING
    assert queued == [("cluster_job", job.pk)]


def test_each_repair_counts_the_machine_s_attempts_to_join_again(committed, queued, room, gpu_b):
    committed(services.cluster_rejoin, cluster=room, member_ids=[member_of(gpu_b).pk], reason="Out of Ray.")

    assert member_of(gpu_b).rejoin_attempts == 1


def test_repairs_give_up_on_a_machine_after_as_many_attempts_as_a_restart_and_it_reads_failed_with_the_reason(
        committed, queued, answers, room, gpu_a, gpu_b, settings):
    ClusterMember.objects.filter(machine=gpu_b).update(rejoin_attempts=settings.FADEN_RESTART_ATTEMPTS, state=MemberState.DOWN)
    answers.update({"gpu-a": head_agent(gpu_a, [node(11), node(12, alive=False)]), "gpu-b": agent(gpu_b)})
    first = check(committed, room)
    queued.clear()

    second = check(committed, room, trigger=CheckTrigger.SECOND_LOOK, first_look=first)

    b = member_of(gpu_b)
    assert second.outcome == CheckOutcome.WAITING
    assert b.state == MemberState.FAILED
    assert b.state_reason.startswith(f"gpu-b did not stay in Ray after {settings.FADEN_RESTART_ATTEMPTS} attempts to join it again")
    assert "Take it out of the cluster" in b.state_reason and b.state_reason in fresh(room).state_reason
    assert jobs_of(room) == [] and queued == []


def test_a_machine_that_never_joined_keeps_its_own_reason_when_a_check_finds_it_out_of_ray(committed, queued, answers,
                                                                                           room, gpu_a, gpu_b):
    ClusterMember.objects.filter(machine=gpu_b).update(state=MemberState.FAILED, state_reason="gpu-b is offline (no heartbeat).")
    answers.update({"gpu-a": head_agent(gpu_a, [node(11)]), "gpu-b": agent(gpu_b)})

    check(committed, room)

    b = member_of(gpu_b)
    assert (b.state, b.state_reason) == (MemberState.FAILED, "gpu-b is offline (no heartbeat).")


def test_a_machine_repairs_gave_up_on_is_up_again_once_a_check_finds_it_in_ray(committed, queued, answers, room, gpu_a, gpu_b):
    ClusterMember.objects.filter(machine=gpu_b).update(rejoin_attempts=3, state=MemberState.FAILED, state_reason="Gave up.")
    all_well(answers, gpu_a, gpu_b)

    check(committed, room)

    b = member_of(gpu_b)
    assert (b.state, b.state_reason, b.rejoin_attempts) == (MemberState.JOINED, "", 0)


def test_a_machine_back_after_a_rejoin_is_up_again_though_ray_still_lists_its_old_node_dead(committed, queued, answers,
                                                                                            room, gpu_a, gpu_b):
    """Ray keeps the node a machine had before it left and joined again (Stop drain, a repair), dead, at the same
    address; wherever it stands in the list, the live node is the machine's (seen in the lab: lab-b stayed Out)."""
    ClusterMember.objects.filter(machine=gpu_b).update(state=MemberState.DOWN, state_reason="gpu-b is offline.")
    answers.update({"gpu-a": head_agent(gpu_a, [node(11), node(12), {**node(12, alive=False), "node_id": "node-old"}]),
                    "gpu-b": agent(gpu_b)})

    check(committed, room)

    b = member_of(gpu_b)
    assert (b.state, b.state_reason, b.ray_node_id) == (MemberState.JOINED, "", "node-12")


def test_a_second_look_that_finds_a_new_problem_looks_again_instead_of_repairing_it(committed, queued, answers, room,
                                                                                  gpu_a, gpu_b):
    answers.update({"gpu-a": head_agent(gpu_a, [node(11), node(12, alive=False)]), "gpu-b": agent(gpu_b)})
    first = check(committed, room)  # a worker out of Ray
    queued.clear()
    head_ray_stopped(answers, gpu_a, gpu_b)

    second = check(committed, room, trigger=CheckTrigger.SECOND_LOOK, first_look=first)  # now the head is down

    assert second.outcome == CheckOutcome.LOOK_AGAIN
    assert second.action.startswith("Looking again")
    assert jobs_of(room) == [] and fresh(room).restart_attempt == 0
    assert [q[2] for q in queued] == [CheckTrigger.SECOND_LOOK]


def test_a_head_back_by_the_second_look_reads_up_again_and_nothing_is_repaired(committed, queued, answers, room, gpu_a, gpu_b):
    head_ray_stopped(answers, gpu_a, gpu_b)
    first = check(committed, room)
    assert member_of(gpu_a).state == MemberState.DOWN
    queued.clear()
    all_well(answers, gpu_a, gpu_b)

    second = check(committed, room, trigger=CheckTrigger.SECOND_LOOK, first_look=first)

    assert second.outcome == CheckOutcome.HEALTHY
    head = member_of(gpu_a)
    assert (head.state, head.state_reason, head.accelerators_in_ray, head.ray_node_id) == (MemberState.JOINED, "", 8, "node-11")
    cluster = fresh(room)
    assert (cluster.state, cluster.state_reason, cluster.restart_attempt) == (ClusterState.RUNNING, "", 0)
    assert jobs_of(room) == [] and queued == []


@pytest.mark.parametrize("second_look", [False, True])
def test_a_check_nobody_answered_changes_nothing(committed, queued, answers, room, gpu_a, gpu_b, second_look):
    answers.update({"gpu-a": silent(gpu_a), "gpu-b": silent(gpu_b, "Could not reach 198.18.0.12 port 22: timed out.")})
    first = HealthCheck.objects.create(cluster=room, trigger=CheckTrigger.SCHEDULE, outcome=CheckOutcome.LOOK_AGAIN) \
        if second_look else None
    before = list(ClusterMember.objects.order_by("pk").values())

    result = check(committed, room, first_look=first)

    assert result.outcome == CheckOutcome.UNANSWERED
    assert "nothing was restarted" in result.action
    cluster = fresh(room)
    assert (cluster.state, cluster.state_reason, cluster.restart_attempt) == (ClusterState.RUNNING, "As the test left it.", 0)
    assert cluster.last_status_at is None
    assert list(ClusterMember.objects.order_by("pk").values()) == before
    assert jobs_of(room) == [] and queued == []


@pytest.mark.parametrize("second_look", [False, True])
def test_a_worker_offline_means_waiting_for_it_with_no_job(committed, queued, answers, room, gpu_a, gpu_b, second_look):
    Machine.objects.filter(pk=gpu_b.pk).update(state=MachineState.OFFLINE, state_reason="No heartbeat for 30 s.")
    answers.update({"gpu-a": head_agent(gpu_a, [node(11), node(12, alive=False)]), "gpu-b": silent(gpu_b, "offline")})
    first = HealthCheck.objects.create(cluster=room, trigger=CheckTrigger.SCHEDULE, outcome=CheckOutcome.LOOK_AGAIN) \
        if second_look else None

    result = check(committed, room, first_look=first)

    assert result.outcome == CheckOutcome.WAITING
    assert result.action == "No repair while a machine is offline: waiting until gpu-b reconnects."
    assert result.found == [{"machine": "gpu-b", "problem": "offline", "text": "gpu-b is offline (No heartbeat for 30 s)."}]
    cluster = fresh(room)
    assert (cluster.state, cluster.state_reason) == (ClusterState.RUNNING, result.action)
    assert member_of(gpu_b).state == MemberState.DOWN
    assert jobs_of(room) == [] and queued == []


def test_a_scheduled_check_leaves_a_busy_cluster_alone_and_a_manual_one_says_why(committed, queued, answers, room):
    JobFactory(kind=steps.ADD.kind, title="Add gpu-c to gpu-room", target_type="cluster", target_id=room.pk,
               state=JobState.RUNNING)

    assert check(committed, room) is None
    manual = check(committed, room, trigger=CheckTrigger.MANUAL, detail="by admin")

    assert HealthCheck.objects.get() == manual
    assert (manual.outcome, manual.action) == (CheckOutcome.SKIPPED, "Nothing looked at: Add gpu-c to gpu-room is under way.")
    assert answers == {}  # nobody was asked


def test_check_now_is_refused_on_a_cluster_that_is_not_running(committed, queued, stopped_room):
    words = refused(committed, services.cluster_check_now, cluster=stopped_room)

    assert words == "gpu-room is Stopped: checks look at a running cluster."
    assert queued == []


def test_check_now_queues_a_manual_check_that_names_who_asked(committed, queued, room, admin_user):
    committed(services.cluster_check_now, cluster=room, user=admin_user)

    assert queued == [("cluster_check", room.pk, CheckTrigger.MANUAL, "by admin")]


def test_the_due_checks_skip_busy_clusters_and_clusters_that_are_not_running(committed, queued, runtime):
    idle = cluster_of([gpu_machine("gpu-a", 11)], name="idle", runtime=runtime)
    busy = cluster_of([gpu_machine("gpu-b", 12)], name="busy", runtime=runtime)
    JobFactory(kind=steps.REJOIN.kind, title="Join gpu-b again", target_type="cluster", target_id=busy.pk)
    for host, state in enumerate((ClusterState.STOPPED, ClusterState.FAILED, ClusterState.STARTING), start=20):
        cluster_of([gpu_machine(f"gpu-{state}", host)], name=state, runtime=runtime, state=state)

    assert committed(health.clusters_check_due) == [idle.pk]

    assert queued == [("cluster_check", idle.pk, CheckTrigger.SCHEDULE, "", None)]


def test_the_due_checks_run_a_lost_second_look_and_wait_for_one_still_due(committed, queued, settings, runtime):
    settings.FADEN_HEALTH_LOOK_AGAIN, settings.FADEN_HEALTH_INTERVAL = 20, 60
    lost = cluster_of([gpu_machine("gpu-a", 11)], name="lost", runtime=runtime)
    due = cluster_of([gpu_machine("gpu-b", 12)], name="due", runtime=runtime)
    long_ago = HealthCheck.objects.create(cluster=lost, trigger=CheckTrigger.SCHEDULE, outcome=CheckOutcome.LOOK_AGAIN)
    HealthCheck.objects.filter(pk=long_ago.pk).update(started_at=timezone.now() - timedelta(minutes=5))
    HealthCheck.objects.create(cluster=due, trigger=CheckTrigger.SCHEDULE, outcome=CheckOutcome.LOOK_AGAIN)

    assert committed(health.clusters_check_due) == [lost.pk]

    assert queued == [("cluster_check", lost.pk, CheckTrigger.SECOND_LOOK, "", long_ago.pk)]


def test_stop_while_machines_join_asks_that_job_to_end_and_queues_the_stop_behind_it(committed, queued, room):
    adding = JobFactory(kind=steps.ADD.kind, title="Add gpu-c to gpu-room", target_type="cluster", target_id=room.pk,
                        state=JobState.RUNNING)

    job = committed(services.cluster_stop, cluster=room)

    adding.refresh_from_db()
    assert adding.cancel_requested and adding.state == JobState.RUNNING  # it ends itself at its next step
    assert job.kind == steps.STOP.kind and fresh(room).state == ClusterState.STOPPING


def test_a_member_machine_going_offline_queues_a_check_of_its_running_cluster(committed, queued, room, gpu_b, settings):
    from machines.services import machines_mark_offline

    settings.FADEN_OFFLINE_AFTER = 30
    Machine.objects.filter(pk=gpu_b.pk).update(last_seen=timezone.now() - timedelta(seconds=31))

    assert committed(machines_mark_offline) == [gpu_b.pk]

    assert [q[:4] for q in queued] == [("cluster_check", room.pk, CheckTrigger.OFFLINE, "gpu-b")]
