"""Failures seen within a heartbeat: a beat that reports Ray or the runtime down on a member of a running
cluster starts its check at once (the first look), the same machine's next beat cues the second look,
one check at a time per cluster; scheduled checks keep their 20 s second look.

Beats go through /agent/heartbeat/ as an agent sends them; checks run through health.cluster_check_run
with the agents' answers from tests/fakes.py, as the worker would run the task the beat queued."""
import hashlib
import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from clusters import health, steps
from clusters.choices import CheckOutcome, CheckTrigger, ClusterState, MemberState
from clusters.models import Cluster, ClusterMember, HealthCheck
from console import live
from console.choices import JobState
from console.models import Job
from machines import beats
from machines.choices import MachineState
from machines.models import Machine
from tests.builders import build, cluster_of, gpu_machine
from tests.factories import JobFactory
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db

GCS = "198.18.1.11:6379"  # gpu-a leads
UP_WORKER = {"container": None, "ray": {"role": "worker", "alive": True, "raylet": True, "head_port_open": None}}
DEAD_WORKER = {"container": None, "ray": {"role": "worker", "alive": False, "raylet": False, "head_port_open": None}}
UP_HEAD = {"container": None, "ray": {"role": "head", "alive": True, "raylet": True, "head_port_open": True}}
DEAD_HEAD = {"container": None, "ray": {"role": "head", "alive": False, "raylet": False, "head_port_open": False}}


def token_of(name: str) -> str:
    return f"token-of-{name}"


def machine(name: str, host: int) -> Machine:
    return gpu_machine(name, host, heartbeat_token_hash=hashlib.sha256(token_of(name).encode()).hexdigest())


@pytest.fixture
def gpu_a():
    return machine("gpu-a", 11)


@pytest.fixture
def gpu_b():
    return machine("gpu-b", 12)


@pytest.fixture
def room(gpu_a, gpu_b):
    """gpu-room, running: gpu-a leads, gpu-b works; both beat as up."""
    Machine.objects.filter(pk=gpu_a.pk).update(runtime_beat=UP_HEAD)
    Machine.objects.filter(pk=gpu_b.pk).update(runtime_beat=UP_WORKER)
    return cluster_of([gpu_a, gpu_b], runtime=build("2.1.0"))


@pytest.fixture(autouse=True)
def no_pushes(monkeypatch):
    monkeypatch.setattr(live, "push", lambda *args, **kwargs: None)


@pytest.fixture(autouse=True)
def intervals(settings):
    settings.FADEN_HEALTH_LOOK_AGAIN, settings.FADEN_HEARTBEAT_INTERVAL = 20, 10


@pytest.fixture
def beat(queued, django_capture_on_commit_callbacks):
    """A machine's agent beats, with this runtime section (None: an agent that sends none)."""
    client = Client(enforce_csrf_checks=True)

    def send(who: Machine, runtime: dict | None):
        body = {"agent_version": "0.3.0"} | ({"runtime": runtime} if runtime is not None else {})
        with django_capture_on_commit_callbacks(execute=True):
            response = client.post("/agent/heartbeat/", json.dumps(body), content_type="application/json",
                                   headers={"Authorization": f"Bearer {token_of(who.name)}"})
        assert response.status_code == 200
        return response

    return send


@pytest.fixture
def answers(monkeypatch):
    return FakeAgents().install(monkeypatch).answers


@pytest.fixture
def run(queued, django_capture_on_commit_callbacks):
    """Run the check a beat queued, as the worker would (the last one queued at once)."""

    def call() -> HealthCheck:
        (_, cluster_id, trigger, detail, first_look_id, check_id) = [q for q in queued if q[0] == "cluster_check"][-1]
        queued.clear()
        with django_capture_on_commit_callbacks(execute=True):
            return health.cluster_check_run(cluster_id=cluster_id, trigger=trigger, detail=detail,
                                            first_look_id=first_look_id, check_id=check_id)

    return call


def agent(who: Machine, *, ray_running: bool = True) -> dict:
    ray = {"running": True, "role": "worker", "gcs_address": GCS} if ray_running else {"running": False, "gcs_address": None}
    return {"machine": who.name, "machine_state": who.state, "runtime": {"state": "started", "ray": ray}}


def head_agent(who: Machine, nodes: list[dict]) -> dict:
    alive = [n for n in nodes if n["alive"]]
    return {**agent(who), "ray": {"nodes": nodes, "alive_nodes": len(alive), "gpus": 8 * len(alive)}}


def node(host: int, *, alive: bool = True) -> dict:
    return {"address": f"198.18.1.{host}", "alive": alive, "gpus": 8, "node_id": f"node-{host}"}


def worker_out_of_ray(answers, gpu_a, gpu_b):
    answers.update({"gpu-a": head_agent(gpu_a, [node(11), node(12, alive=False)]), "gpu-b": agent(gpu_b, ray_running=False)})


def all_well(answers, gpu_a, gpu_b):
    answers.update({"gpu-a": head_agent(gpu_a, [node(11), node(12)]), "gpu-b": agent(gpu_b)})


def checks(cluster: Cluster) -> list[HealthCheck]:
    return list(HealthCheck.objects.filter(cluster=cluster).order_by("pk"))


def member_of(who: Machine) -> ClusterMember:
    return ClusterMember.objects.get(machine=who)


# -- what a beat says -------------------------------------------------------------------------------


def test_a_runtime_section_is_read_strictly_and_anything_else_reads_as_not_known():
    assert beats.runtime_report(None) is None and beats.runtime_report("up") is None
    assert beats.runtime_report({"container": "paused", "ray": {"role": "boss", "alive": "yes", "raylet": 1}}) == {
        "container": None, "ray": {"role": None, "alive": None, "raylet": False, "head_port_open": None}}
    assert beats.runtime_failure(beats.runtime_report({"container": "paused", "ray": {"alive": "no"}})) == ""


@pytest.mark.parametrize("report, words", [
    (UP_WORKER, ""),
    (DEAD_WORKER, "Ray is not running"),
    ({"container": None, "ray": {"role": "head", "alive": False, "raylet": True, "head_port_open": False}},
     "Ray's head port does not answer"),
    ({"container": "exited", "ray": {"role": "worker", "alive": False, "raylet": False, "head_port_open": None}},
     "the runtime container stopped"),
    ({"container": "absent", "ray": {"role": None, "alive": None, "raylet": False, "head_port_open": None}},
     "the runtime container is gone"),
    ({"container": None, "ray": {"role": None, "alive": None, "raylet": False, "head_port_open": None}}, ""),
])
def test_what_a_runtime_section_says_is_wrong(report, words):
    assert beats.runtime_failure(report) == words


# -- a change starts a check ------------------------------------------------------------------------


def test_a_worker_s_beat_that_reports_ray_gone_starts_its_cluster_s_check_at_once(beat, queued, room, gpu_b):
    beat(gpu_b, DEAD_WORKER)

    (check,) = checks(room)
    assert (check.trigger, check.outcome, check.beat_machine_id) == (CheckTrigger.HEARTBEAT, CheckOutcome.RUNNING, gpu_b.pk)
    assert check.trigger_detail == "from gpu-b: Ray is not running"
    assert f"{check.get_trigger_display()} {check.trigger_detail}" == "A heartbeat from gpu-b: Ray is not running"
    assert queued == [("cluster_check", room.pk, CheckTrigger.HEARTBEAT, "from gpu-b: Ray is not running", None, check.pk)]
    gpu_b.refresh_from_db()
    assert gpu_b.runtime_beat == DEAD_WORKER and gpu_b.runtime_failing_since is not None


def test_beats_that_report_nothing_new_start_no_check(beat, queued, room, gpu_a, gpu_b):
    beat(gpu_b, UP_WORKER)
    beat(gpu_a, UP_HEAD)
    Machine.objects.filter(pk=gpu_b.pk).update(runtime_beat={})
    beat(gpu_b, UP_WORKER)  # the first beat of a new agent: up, as the checks last saw it
    beat(gpu_b, None)  # an older agent says nothing of its runtime

    assert checks(room) == [] and queued == []
    gpu_b.refresh_from_db()
    assert gpu_b.runtime_beat == UP_WORKER and gpu_b.runtime_failing_since is None


def test_a_failure_the_checks_have_seen_starts_no_check_at_every_beat(beat, queued, answers, room, gpu_a, gpu_b, run):
    worker_out_of_ray(answers, gpu_a, gpu_b)
    beat(gpu_b, DEAD_WORKER)
    first = run()
    HealthCheck.objects.filter(pk=first.pk).update(outcome=CheckOutcome.HEALTHY)  # say the look disagreed
    queued.clear()

    beat(gpu_b, DEAD_WORKER)
    beat(gpu_b, DEAD_WORKER)

    assert checks(room) == [first] and queued == []


def test_one_check_at_a_time_when_the_head_and_a_worker_report_at_once(beat, queued, room, gpu_a, gpu_b):
    beat(gpu_a, DEAD_HEAD)
    beat(gpu_b, DEAD_WORKER)
    beat(gpu_a, DEAD_HEAD)

    (check,) = checks(room)
    assert check.trigger_detail == "from gpu-a: Ray is not running"
    assert [q[0] for q in queued] == ["cluster_check"]


def test_no_heartbeat_check_while_a_scheduled_one_is_looking(beat, queued, room, gpu_b):
    looking = HealthCheck.objects.create(cluster=room, trigger=CheckTrigger.SCHEDULE)

    beat(gpu_b, DEAD_WORKER)

    assert checks(room) == [looking] and queued == []


def test_a_failure_that_began_after_the_latest_check_started_is_checked_at_the_next_beat(beat, queued, room, gpu_b):
    """A scheduled check that was looking when Ray died may have missed it: the next beat that still
    reports it starts a check of its own."""
    looking = HealthCheck.objects.create(cluster=room, trigger=CheckTrigger.SCHEDULE)
    beat(gpu_b, DEAD_WORKER)
    HealthCheck.objects.filter(pk=looking.pk).update(outcome=CheckOutcome.HEALTHY, finished_at=timezone.now())

    beat(gpu_b, DEAD_WORKER)

    assert checks(room)[-1].trigger == CheckTrigger.HEARTBEAT and len(checks(room)) == 2


def test_a_heartbeat_from_a_machine_in_no_cluster_is_recorded_and_starts_nothing(beat, queued):
    loner = machine("gpu-z", 30)

    beat(loner, DEAD_WORKER)

    assert HealthCheck.objects.count() == 0 and queued == []
    loner.refresh_from_db()
    assert loner.runtime_beat == DEAD_WORKER


@pytest.mark.parametrize("state", [ClusterState.STARTING, ClusterState.STOPPED])
def test_a_heartbeat_from_a_cluster_that_is_not_running_starts_nothing(beat, queued, gpu_a, gpu_b, state):
    cluster = cluster_of([gpu_a, gpu_b], state=state)

    beat(gpu_b, DEAD_WORKER)

    assert checks(cluster) == [] and queued == []


def test_a_heartbeat_during_a_repair_starts_nothing(beat, queued, room, gpu_b):
    JobFactory(kind=steps.REJOIN.kind, title="Join gpu-b again", target_type="cluster", target_id=room.pk, state=JobState.RUNNING)

    beat(gpu_b, DEAD_WORKER)  # the repair stopped Ray there

    assert checks(room) == [] and queued == []


def test_the_beat_that_brings_a_machine_back_is_checked_as_a_reconnection_only(beat, queued, room, gpu_b):
    Machine.objects.filter(pk=gpu_b.pk).update(state=MachineState.OFFLINE)

    beat(gpu_b, DEAD_WORKER)

    assert checks(room) == []
    assert [q[:4] for q in queued] == [("cluster_check", room.pk, CheckTrigger.RECONNECT, "gpu-b")]


# -- the next beat is the second look --------------------------------------------------------------


def test_the_first_look_waits_for_the_machine_s_next_heartbeat_with_a_timer_behind_it(beat, queued, answers, room,
                                                                                      gpu_a, gpu_b, run, settings):
    worker_out_of_ray(answers, gpu_a, gpu_b)
    beat(gpu_b, DEAD_WORKER)

    first = run()

    assert first.outcome == CheckOutcome.LOOK_AGAIN
    assert first.action == "Looking again at gpu-b's next heartbeat before joining gpu-b again."
    cluster = Cluster.objects.get(pk=room.pk)
    assert cluster.state_reason == f"Ray is not running on gpu-b. {first.action}"
    assert member_of(gpu_b).state == MemberState.DOWN
    assert Job.objects.count() == 0  # nothing repaired on a first look
    # Two beats (20 s at 10 s a beat), never sooner than a scheduled check's second look.
    assert queued == [("cluster_check later", room.pk, CheckTrigger.SECOND_LOOK, "", first.pk, 20)]
    settings.FADEN_HEARTBEAT_INTERVAL = 15
    assert health.beat_confirm_countdown() == 30


def test_the_next_heartbeat_that_still_reports_the_failure_is_the_second_look_and_the_worker_joins_again(
        beat, queued, answers, room, gpu_a, gpu_b, run, django_capture_on_commit_callbacks):
    worker_out_of_ray(answers, gpu_a, gpu_b)
    beat(gpu_b, DEAD_WORKER)
    first = run()
    queued.clear()

    beat(gpu_b, DEAD_WORKER)

    second = checks(room)[-1]
    assert (second.trigger, second.first_look_id, second.outcome) == (CheckTrigger.SECOND_LOOK, first.pk, CheckOutcome.RUNNING)
    assert second.trigger_detail == "gpu-b's next heartbeat still says: Ray is not running"
    assert queued == [("cluster_check", room.pk, CheckTrigger.SECOND_LOOK, second.trigger_detail, first.pk, second.pk)]

    done = run()

    assert done.pk == second.pk and done.outcome == CheckOutcome.REPAIR
    assert done.action.startswith("Taking gpu-b out of Ray and joining it again")
    (job,) = Job.objects.filter(target_type="cluster", target_id=room.pk)
    assert job.kind == steps.REJOIN.kind and queued == [("cluster_job", job.pk)]
    # Looked twice, in that order.
    assert [c.outcome for c in checks(room)] == [CheckOutcome.LOOK_AGAIN, CheckOutcome.REPAIR]
    # The timer behind the first look finds its second look done, and writes nothing.
    with django_capture_on_commit_callbacks(execute=True):
        late = health.cluster_check_run(cluster_id=room.pk, trigger=CheckTrigger.SECOND_LOOK, first_look_id=first.pk)
    assert late is None and len(checks(room)) == 2


def test_the_head_s_next_heartbeat_still_down_restarts_the_cluster_after_two_looks(beat, queued, answers, room,
                                                                                    gpu_a, gpu_b, run):
    answers.update({"gpu-a": {**agent(gpu_a, ray_running=False), "ray_error": "Ray is not running here."},
                    "gpu-b": agent(gpu_b)})
    beat(gpu_a, DEAD_HEAD)
    first = run()
    assert first.action == ("Looking again at gpu-a's next heartbeat before restarting the cluster: "
                            "a slow answer is not a dead head.")
    beat(gpu_b, UP_WORKER)  # another machine's beat is not the cue

    beat(gpu_a, DEAD_HEAD)
    second = run()

    assert second.outcome == CheckOutcome.REPAIR
    assert second.action == "Restarting the cluster (attempt 1 of 3): Ray is not running on the head gpu-a."
    cluster = Cluster.objects.get(pk=room.pk)
    assert (cluster.state, cluster.restart_attempt) == (ClusterState.STARTING, 1)


def test_a_blip_the_next_heartbeat_reports_healed_settles_as_all_well(beat, queued, answers, room, gpu_a, gpu_b, run):
    worker_out_of_ray(answers, gpu_a, gpu_b)
    beat(gpu_b, DEAD_WORKER)
    run()
    all_well(answers, gpu_a, gpu_b)

    beat(gpu_b, UP_WORKER)
    second = run()

    assert second.trigger_detail == "gpu-b's next heartbeat says it is up again"
    assert second.outcome == CheckOutcome.HEALTHY
    assert member_of(gpu_b).state == MemberState.JOINED
    cluster = Cluster.objects.get(pk=room.pk)
    assert (cluster.state, cluster.state_reason) == (ClusterState.RUNNING, "")
    assert Job.objects.count() == 0
    gpu_b.refresh_from_db()
    assert gpu_b.runtime_failing_since is None


def test_a_heartbeat_check_whose_cluster_got_busy_before_it_ran_reads_skipped_with_the_reason(beat, queued, room, gpu_b, run):
    beat(gpu_b, DEAD_WORKER)
    JobFactory(kind=steps.STOP.kind, title="Stop gpu-room", target_type="cluster", target_id=room.pk, state=JobState.RUNNING)

    check = run()

    assert check.outcome == CheckOutcome.SKIPPED and check.action == "Nothing looked at: Stop gpu-room is under way."
    assert run_again_is_nothing(room, check)


def run_again_is_nothing(cluster: Cluster, check: HealthCheck) -> bool:
    """The task run twice (a redelivery) finds its check answered and writes nothing."""
    return health.cluster_check_run(cluster_id=cluster.pk, trigger=check.trigger, check_id=check.pk) is None


# -- scheduled checks keep theirs -------------------------------------------------------------------


def test_a_scheduled_first_look_keeps_its_20_s_second_look_and_beats_do_not_cue_it(beat, queued, answers, room,
                                                                                     gpu_a, gpu_b,
                                                                                     django_capture_on_commit_callbacks):
    beat(gpu_b, DEAD_WORKER)  # the beat's own check is under way ...
    HealthCheck.objects.all().delete()  # ... say it was the scheduled one that saw it first
    queued.clear()
    worker_out_of_ray(answers, gpu_a, gpu_b)
    with django_capture_on_commit_callbacks(execute=True):
        first = health.cluster_check_run(cluster_id=room.pk, trigger=CheckTrigger.SCHEDULE)

    assert first.action == "Looking again in 20 s before joining gpu-b again."
    assert queued == [("cluster_check later", room.pk, CheckTrigger.SECOND_LOOK, "", first.pk, 20)]
    queued.clear()

    beat(gpu_b, DEAD_WORKER)

    assert checks(room) == [first] and queued == []
    with django_capture_on_commit_callbacks(execute=True):
        second = health.cluster_check_run(cluster_id=room.pk, trigger=CheckTrigger.SECOND_LOOK, first_look_id=first.pk)
    assert second.outcome == CheckOutcome.REPAIR


def test_the_failing_since_of_a_machine_is_kept_while_it_fails_and_cleared_when_it_is_up(beat, room, gpu_b, queued):
    beat(gpu_b, DEAD_WORKER)
    gpu_b.refresh_from_db()
    since = gpu_b.runtime_failing_since
    Machine.objects.filter(pk=gpu_b.pk).update(runtime_failing_since=since - timedelta(seconds=1))
    exited = {"container": "exited", "ray": DEAD_WORKER["ray"]}

    beat(gpu_b, exited)  # another failure, still failing: the same onset

    gpu_b.refresh_from_db()
    assert gpu_b.runtime_failing_since == since - timedelta(seconds=1)
    beat(gpu_b, UP_WORKER)
    gpu_b.refresh_from_db()
    assert gpu_b.runtime_failing_since is None

