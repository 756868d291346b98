"""A machine's drain with fake agents: Ray is told on the head; each copy's replacement reads Serving (and the
gateway has read its routes) before the old copy leaves the rotation and stops; copies agreed to stop read Queued
with the drain's words and start again once there is room; a job taken up again starts no copy twice; Stop drain
joins the machine to Ray again and restarts its copies; Remove drains, then the machine leaves the cluster; the
head and a second drain are refused in the product's words."""
import pytest
from django.core.exceptions import PermissionDenied, ValidationError

from clusters import steps
from clusters.choices import ClusterState, MemberState
from clusters.models import ClusterMember
from console import roles
from console.choices import JobState
from console.models import Job
from deployments import drain, drain_job, services, serving
from deployments.choices import CopyState, DrainState
from deployments.models import Copy, Deployment, Drain
from tests.factories import UserFactory
from tests.unit.test_deployments import ask, cluster, fakes, model, operator  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)  # copies start from a pool of threads

NODE = "ab" * 28


@pytest.fixture(autouse=True)
def quick(settings, monkeypatch):
    """No gateway to wait for (the requests in flight finish at once, well within the grace); each wait for the
    routes or the requests is recorded with the copies' states then."""
    settings.FADEN_DRAIN_GRACE = 60
    monkeypatch.setattr(drain_job, "POLL_SECONDS", 0.01)
    seen = []
    monkeypatch.setattr(drain_job, "routes_read_since",
                        lambda since, **kw: seen.append(dict(Copy.objects.values_list("number", "state"))))
    monkeypatch.setattr(drain_job, "requests_finished",
                        lambda ids, since, **kw: seen.append(dict(Copy.objects.values_list("number", "state"))) or 0)
    return seen


@pytest.fixture
def deployment(cluster, model, fakes, operator):
    ClusterMember.objects.filter(cluster=cluster).update(ray_node_id=NODE)
    made = services.deployment_create(ask=ask(cluster, model, copies=2, gpu_quarters=4, memory_per_gpu_mib=30000),
                                      user=operator)
    assert set(made.copy_rows.values_list("state", flat=True)) == {CopyState.SERVING}
    return made


def worker_copy(deployment) -> Copy:
    """A copy on a machine that does not lead (the head cannot be drained while the cluster runs)."""
    return next(c for c in deployment.copy_rows.select_related("machine").order_by("number")
                if c.machine.membership.role != "head")


def free_machine(cluster, deployment):
    """The machine that runs no copy."""
    taken = set(deployment.copy_rows.values_list("machine_id", flat=True))
    return next(m.machine for m in cluster.members.select_related("machine") if m.machine_id not in taken)


def move_plan(copy: Copy, to) -> dict:
    return {"moves": [{"copy": copy.pk, "to": to.pk, "slots": []}], "stops": []}


def calls(fakes, *methods):
    return [(machine, method, kw.get("copy", "")) for machine, method, kw in fakes.calls if method in methods]


def test_a_drain_starts_each_replacement_and_sees_it_serve_before_the_old_copy_leaves_the_rotation_and_stops(
        cluster, deployment, fakes, operator, quick):
    old = worker_copy(deployment)
    target = free_machine(cluster, deployment)
    fakes.calls.clear()

    started = drain.drain_start(cluster, old.machine, move_plan(old, target), user=operator)

    row = Drain.objects.get(pk=started.pk)
    job = Job.objects.get(pk=row.job_id)
    assert job.state == JobState.SUCCEEDED, job.error
    assert row.state == DrainState.DRAINED
    head = cluster.members.get(role="head").machine.name
    assert [(m, kw["node_id"]) for m, method, kw in fakes.calls if method == "ray_drain"] == [(head, NODE)]
    new = deployment.copy_rows.exclude(number__in=[1, 2]).get()
    assert (new.machine_id, new.state) == (target.pk, CopyState.SERVING)
    order = calls(fakes, "copy_start", "copy_stop")
    assert order == [(target.name, "copy_start", new.key), (old.machine.name, "copy_stop", old.key)]
    # The gateway was waited for with the replacement serving and the old copy still in, then the old one's requests.
    assert quick[0][new.number] == CopyState.SERVING and quick[0][old.number] == CopyState.SERVING
    assert quick[1][old.number] == CopyState.STOPPING
    assert not Copy.objects.filter(pk=old.pk).exists()
    assert [s["state"] for s in job.steps] == ["done", "done", "done"]
    # A drained machine takes no new copy.
    services.deployment_scale(deployment=deployment, copies=3, user=operator)
    assert not deployment.copy_rows.filter(machine=old.machine).exists()


def test_copies_agreed_to_stop_read_queued_with_the_drain_s_words_and_start_again_once_the_drain_is_stopped(
        cluster, deployment, fakes, operator, monkeypatch):
    old = worker_copy(deployment)
    cluster.members.exclude(machine=old.machine).update(state=MemberState.DOWN)  # no room elsewhere
    fakes.calls.clear()

    row = drain.drain_start(cluster, old.machine, {"moves": [], "stops": [{"copy": old.pk, "reason": "no room"}]},
                            user=operator)

    old.refresh_from_db()
    assert Drain.objects.get(pk=row.pk).state == DrainState.DRAINED
    assert old.state == CopyState.QUEUED and old.machine_id is None
    assert f"stopped by the drain of {row.machine.name}" in old.state_reason
    assert calls(fakes, "copy_stop") == [(row.machine.name, "copy_stop", old.key)]

    rejoins = []
    monkeypatch.setattr("clusters.services.cluster_rejoin",
                        lambda **kw: rejoins.append(kw) or Job(pk=0, title="Join again"))
    drain.drain_stop(row.machine, user=operator)

    assert Drain.objects.get(pk=row.pk).state == DrainState.STOPPING
    [rejoin] = rejoins
    assert rejoin["member_ids"] == [cluster.members.get(machine=row.machine).pk]
    # Back in Ray: the drain's row goes and the queued copy starts again where there is room (its old machine).
    from clusters.lifecycle import members_transition

    ClusterMember.objects.filter(machine=row.machine).update(state=MemberState.REJOINING)
    members_transition(ClusterMember.objects.filter(machine=row.machine), to=MemberState.JOINED)
    assert not Drain.objects.filter(pk=row.pk).exists()
    old.refresh_from_db()
    assert (old.state, old.machine_id) == (CopyState.SERVING, row.machine_id)


def test_a_drain_taken_up_again_after_its_worker_died_starts_no_copy_twice(cluster, deployment, fakes, operator,
                                                                           monkeypatch):
    old = worker_copy(deployment)
    target = free_machine(cluster, deployment)
    # The first worker dies right after the replacement was recorded and started.
    real = drain_job._hand_over

    def dies(*args, **kwargs):
        raise SystemExit("the worker died")

    monkeypatch.setattr(drain_job, "_hand_over", dies)
    with pytest.raises(SystemExit):
        drain.drain_start(cluster, old.machine, move_plan(old, target), user=operator)
    row = Drain.objects.get(machine=old.machine)
    assert row.state == DrainState.MOVING
    starts_before = len(calls(fakes, "copy_start"))
    monkeypatch.setattr(drain_job, "_hand_over", real)

    Job.objects.filter(pk=row.job_id).update(state=JobState.QUEUED, resumes=1)
    from deployments import tasks
    tasks.machine_drain(row.job_id)

    job = Job.objects.get(pk=row.job_id)
    assert job.state == JobState.SUCCEEDED, job.error
    assert len(calls(fakes, "copy_start")) == starts_before  # the replacement was not started again
    assert Drain.objects.get(pk=row.pk).state == DrainState.DRAINED
    assert deployment.copy_rows.count() == 2 and not deployment.copy_rows.filter(machine=old.machine).exists()


def test_remove_from_a_running_cluster_drains_then_the_machine_leaves_ray_and_the_cluster(cluster, deployment, fakes,
                                                                                          operator):
    old = worker_copy(deployment)
    machine = old.machine
    fakes.calls.clear()

    drain.machine_remove(cluster, machine, {"moves": [], "stops": [{"copy": old.pk, "reason": "agreed"}]}, user=operator)

    assert not Drain.objects.filter(machine=machine).exists()
    assert not cluster.members.filter(machine=machine).exists()
    machine.refresh_from_db()  # still enrolled
    mine = [method for m, method, _ in fakes.calls if m == machine.name]
    assert mine.index("copy_stop") < mine.index("ray_stop") < mine.index("runtime_stop")
    leave = Job.objects.get(kind=steps.LEAVE.kind)
    assert leave.params["machine_id"] == machine.pk
    # The others' node settings are written again, without it.
    others = set(cluster.members.values_list("machine__name", flat=True))
    assert set(fakes.node_files) == others and machine.name not in str(fakes.node_files)


def test_the_head_a_second_drain_and_a_viewer_are_refused_in_words(cluster, deployment, operator):
    head = cluster.members.get(role="head").machine
    with pytest.raises(ValidationError, match="the cluster cannot run without it. Stop the cluster instead, or drain the "
                                              "other machines."):
        drain.drain_start(cluster, head, {}, user=operator)
    viewer = UserFactory(username="viewer-drain", role=roles.VIEWER)
    worker = worker_copy(deployment).machine
    with pytest.raises(PermissionDenied, match="needs an Operator"):
        drain.drain_start(cluster, worker, {}, user=viewer)
    with pytest.raises(ValidationError, match="not on"):
        drain.drain_start(cluster, worker, {"moves": [], "stops": [{"copy": 999999}]}, user=operator)
    Drain.objects.create(machine=worker, cluster=cluster)
    with pytest.raises(ValidationError, match="already draining"):
        drain.drain_start(cluster, worker, {}, user=operator)
    cluster.state = ClusterState.STOPPED
    cluster.save()
    assert "running cluster" in drain.drain_refusal(cluster, cluster.members.get(machine=head))


def test_a_health_check_does_not_join_a_drained_machine_again(cluster):
    from clusters import hooks

    worker = cluster.members.exclude(role="head").first()
    assert hooks.held_out_of_ray(cluster) == set()
    Drain.objects.create(machine=worker.machine, cluster=cluster, state=DrainState.DRAINED)
    assert hooks.held_out_of_ray(cluster) == {worker.machine_id}
    Drain.objects.filter(machine=worker.machine).update(state=DrainState.STOPPING)
    assert hooks.held_out_of_ray(cluster) == set()


def test_a_copy_leaving_a_draining_machine_is_not_stopped_by_its_apply_job_before_the_grace(cluster, deployment, settings):
    settings.FADEN_DRAIN_GRACE = 60
    old = worker_copy(deployment)
    Drain.objects.create(machine=old.machine, cluster=cluster, state=DrainState.MOVING)
    serving.copy_transition(old, to=CopyState.STOPPING, reason="Moved.")
    serving.stops(deployment)
    assert Copy.objects.get(pk=old.pk).state == CopyState.STOPPING
    settings.FADEN_DRAIN_GRACE = 0
    serving.stops(deployment)
    assert not Copy.objects.filter(pk=old.pk).exists()


def test_a_copy_whose_replacement_does_not_start_keeps_serving_and_the_drain_says_so(cluster, deployment, fakes,
                                                                                   operator, settings, monkeypatch):
    """A replacement that failed is said at once, with why (nothing starts it again: waiting for
    FADEN_DRAIN_STUCK would only say it later)."""
    settings.FADEN_DRAIN_STUCK = 30 * 60
    old = worker_copy(deployment)
    target = free_machine(cluster, deployment)
    fakes.answers[target.name] = {"copy_error": ("not_retryable", "CUDA error: out of memory")}
    looks = []
    real = drain_job._still_draining

    def three_looks(ctx, row):
        looks.append(1)
        if len(looks) > 3:  # Stop drain, as the person reading the sentence would
            raise drain_job.JobCancelled()
        return real(ctx, row)

    monkeypatch.setattr(drain_job, "_still_draining", three_looks)

    row = drain.drain_start(cluster, old.machine, move_plan(old, target), user=operator)

    row.refresh_from_db()
    assert Job.objects.get(pk=row.job_id).state == JobState.CANCELLED
    assert row.state == DrainState.MOVING
    assert row.state_reason == (f"{old} has not moved: its replacement failed (#3 on {target.name}: CUDA error: out of "
                                f"memory). It keeps serving here. Read the deployment's errors, or stop the drain."), row.state_reason
    assert Copy.objects.get(pk=old.pk).state == CopyState.SERVING  # nothing stopped early
    assert [kw["copy"] for _, method, kw in fakes.calls if method == "copy_stop"] == []
    # Stop drain: the replacement that did not start goes; the copy stays where it serves.
    monkeypatch.setattr("clusters.services.cluster_rejoin", lambda **kw: None)
    drain.drain_stop(old.machine, user=operator)
    assert list(deployment.copy_rows.values_list("number", "state")) == [(1, CopyState.SERVING), (2, CopyState.SERVING)]
    assert [kw["copy"] for _, method, kw in fakes.calls if method == "copy_stop"] == [f"d{deployment.pk}-c3"]


def test_the_gateway_says_which_copies_out_of_its_routes_still_answer_its_requests_until_they_have():
    from deployments.gateway.routes import RouteTable, Snapshot

    table = RouteTable()
    table.apply(Snapshot(deployments=(("chat", 1, 0),), copies=((7, 1, 1, "198.18.1.12", 8100, "s"),), keys=()))
    table.copies[7].in_flight = 2
    table.apply(Snapshot(deployments=(("chat", 1, 0),), copies=(), keys=()))  # it left the routes (a drain)
    assert table.leaving_in_flight() == {7: 2}
    table.leaving[7].in_flight = 0  # its last answers came back
    assert table.leaving_in_flight() == {}


# -- the cluster stops under a drain ----------------------------------------------------------------


def moving(cluster, copy: Copy, *, moved: dict, remove: bool = False) -> Drain:
    """A drain of ``copy``'s machine caught Moving copies, its job running with ``moved`` as its params say."""
    from tests.factories import JobFactory

    job = JobFactory(kind=drain.KIND, state=JobState.RUNNING, target_type="cluster", target_id=cluster.pk,
                     params={"moved": moved})
    return Drain.objects.create(machine=copy.machine, cluster=cluster, state=DrainState.MOVING, remove=remove, job=job,
                                plan=move_plan(copy, copy.machine))


def stopping_the_cluster(cluster) -> None:
    from django.db import transaction

    from deployments.apps import _cluster_stopping

    with transaction.atomic():  # as clusters' stop sends it
        _cluster_stopping(None, cluster)


def test_a_cluster_stopped_in_the_middle_of_a_drain_leaves_the_machine_drained_with_its_replacement_in_its_place(
        cluster, deployment, fakes):
    old = worker_copy(deployment)
    replacement = deployment.copy_rows.exclude(pk=old.pk).get()  # as if started by the drain, serving
    row = moving(cluster, old, moved={str(old.pk): replacement.pk})

    stopping_the_cluster(cluster)

    row.refresh_from_db()
    assert (row.state, row.state_reason) == (
        DrainState.DRAINED, f"{cluster.name} stopped before {old.machine.name} was drained: nothing runs on it, and "
                            "nothing is placed there when the cluster starts again.")
    assert Job.objects.get(pk=row.job_id).cancel_requested
    assert not Copy.objects.filter(pk=old.pk).exists()
    assert list(deployment.copy_rows.values_list("pk", "state")) == [(replacement.pk, CopyState.STOPPED)]


def test_a_copy_not_moved_yet_when_the_cluster_stops_is_placed_elsewhere_at_the_next_start_and_a_removal_becomes_a_drain(
        cluster, deployment, fakes):
    old = worker_copy(deployment)
    row = moving(cluster, old, moved={}, remove=True)
    drained = old.machine

    stopping_the_cluster(cluster)
    row.refresh_from_db()
    assert (row.state, row.remove) == (DrainState.DRAINED, False)
    assert row.state_reason.endswith("Remove from cluster takes it out now that the cluster is stopped.")
    old.refresh_from_db()
    assert (old.state, old.machine_id, old.slots) == (CopyState.STOPPED, None, [])

    fakes.copies.clear()  # the runtime's stop ended the engines
    serving.cluster_running(cluster)

    placed = Copy.objects.get(pk=old.pk)
    assert placed.state == CopyState.SERVING and placed.machine_id not in (None, drained.pk)


def test_a_drain_being_stopped_when_the_cluster_stops_is_over_and_a_drained_machine_stays_drained(cluster, deployment):
    old = worker_copy(deployment)
    other = deployment.copy_rows.exclude(pk=old.pk).select_related("machine").get()
    Drain.objects.create(machine=old.machine, cluster=cluster, state=DrainState.STOPPING)
    Drain.objects.create(machine=other.machine, cluster=cluster, state=DrainState.DRAINED, state_reason="Drained.")

    stopping_the_cluster(cluster)

    assert list(Drain.objects.values_list("machine_id", "state", "state_reason")) == [
        (other.machine_id, DrainState.DRAINED, "Drained.")]


def test_copies_whose_replacements_are_late_are_named_with_the_setting_s_time_and_failed_ones_with_why(settings):
    settings.FADEN_DRAIN_STUCK = 30 * 60
    a, b, c = (Copy(pk=pk, number=pk, deployment=Deployment(name="chat")) for pk in (1, 2, 3))
    assert drain_job._stuck_words([a, b], {}) == (
        f"{a}, {b} have not moved after 30 minutes: the replacement did not start. They keep serving here. Read the "
        "deployment's errors, or stop the drain.")
    assert drain_job._stuck_words([a, c], {3: "#4 on lab-c: not enough memory"}) == (
        f"{c} has not moved: its replacement failed (#4 on lab-c: not enough memory). {a} has not moved after 30 "
        "minutes: the replacement did not start. They keep serving here. Read the deployment's errors, or stop the drain.")
