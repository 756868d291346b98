"""Deploying a model, with fake agents: the plan, copies started on exactly their GPUs and ports, scaling
that touches only the difference, delete, the cluster's stop and start, and refusals in words."""
import pytest
from django.core.exceptions import PermissionDenied, ValidationError

from clusters.choices import ClusterState
from console import roles
from console.models import Job
from deployments import copy_keys, services, serving
from deployments.choices import CopyState
from deployments.models import Copy, Deployment, ModelFile
from deployments.store import disk
from tests.builders import cluster_of, gpu_machine, ready_model
from tests.factories import UserFactory
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # copies start from a pool of threads

MiB = 1 << 20
H100_MIB = 81559


@pytest.fixture
def operator():
    return UserFactory(role=roles.OPERATOR)


@pytest.fixture
def model():
    model = ready_model("org/chat", weight_bytes=16 * 2**30)
    model.facts["gpu_memory_bytes"] = int(16 * 2**30 * 1.2)
    model.save(update_fields=["facts"])
    ModelFile.objects.create(model=model, path="model.safetensors", size=40 * MiB, sha256="2" * 64,
                             chunk_size=disk.CHUNK_SIZE, chunk_hashes=["b" * 64] * 5)
    return model


@pytest.fixture
def cluster():
    return cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12), gpu_machine("lab-c", 13)])


@pytest.fixture
def fakes(monkeypatch):
    return FakeAgents().install(monkeypatch)


def ask(cluster, model, **changes) -> services.DeployAsk:
    fields = dict(cluster=cluster, model=model, name="chat", copies=2, gpu_quarters=8, vendor="nvidia",
                  gpu_model="NVIDIA H100 80GB HBM3", gpu_memory_mib=H100_MIB, arch="x86_64",
                  memory_per_gpu_mib=70000, context_length=4096)
    return services.DeployAsk(**(fields | changes))


def starts(fakes) -> list[tuple[str, dict]]:
    return [(name, kw) for name, method, kw in fakes.calls if method == "copy_start"]


def test_the_plan_spreads_two_copies_of_two_gpus_over_two_machines_and_writes_nothing(cluster, model):
    plan = services.deployment_plan(ask(cluster, model))
    assert not plan.unplaced
    machines = [p.slots[0].machine_id for p in plan.placed]
    assert len(set(machines)) == 2
    assert all(len(p.slots[0].gpu_indices) == 2 for p in plan.placed)
    assert not Deployment.objects.exists()


def test_deploy_puts_the_files_on_the_copies_machines_and_starts_each_on_exactly_its_gpus(cluster, model, fakes, operator):
    deployment = services.deployment_create(ask=ask(cluster, model), user=operator)

    copies = list(deployment.copy_rows.select_related("machine"))
    assert [c.state for c in copies] == [CopyState.SERVING, CopyState.SERVING], [c.state_reason for c in copies]
    placed_on = {name for name, method, _ in fakes.calls if method == "model_place"}
    assert placed_on == {c.machine.name for c in copies}  # the third machine gets no files
    for name, kw in starts(fakes):
        copy = next(c for c in copies if c.key == kw["copy"])
        assert name == copy.machine.name and kw["port"] == copy.port and 8100 <= copy.port <= 8199
        assert kw["env"] == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, copy.slots[0]["gpus"])),
                             "VLLM_API_KEY": copy_keys.copy_key_of(copy.pk, copy.api_key_sealed)}
        assert kw["argv"][:3] == ["vllm", "serve", f"/var/lib/fadenstack/models/org--chat/{'c' * 40}"]
        assert kw["argv"][kw["argv"].index("--host") + 1] == copy.address == f"198.18.1.{copy.machine.address.rsplit('.', 1)[1]}"
        assert copy.pid == fakes.copies[name][copy.key]["pid"]
    assert Job.objects.get(kind=serving.KIND).state == "succeeded"


def test_scaling_up_and_down_starts_or_stops_only_the_difference(cluster, model, fakes, operator):
    deployment = services.deployment_create(ask=ask(cluster, model), user=operator)
    first_pids = dict(deployment.copy_rows.values_list("number", "pid"))

    services.deployment_scale(deployment=deployment, copies=3, user=operator)
    assert len(starts(fakes)) == 3  # one more start, none again
    after = dict(deployment.copy_rows.values_list("number", "pid"))
    assert {n: after[n] for n in first_pids} == first_pids
    assert set(deployment.copy_rows.values_list("state", flat=True)) == {CopyState.SERVING}
    assert len({c.machine_id for c in deployment.copy_rows.all()}) == 3  # spread over the three machines

    services.deployment_scale(deployment=deployment, copies=1, user=operator)
    stopped = [kw["copy"] for _, method, kw in fakes.calls if method == "copy_stop"]
    assert sorted(stopped) == [f"d{deployment.pk}-c2", f"d{deployment.pk}-c3"]  # the newest go
    assert list(deployment.copy_rows.values_list("number", "pid", "state")) == [(1, first_pids[1], CopyState.SERVING)]
    assert Deployment.objects.get(pk=deployment.pk).copies == 1


def test_copies_that_do_not_fit_are_refused_with_why_or_queued_when_asked(cluster, model, fakes, operator):
    too_many = ask(cluster, model, copies=4, gpu_quarters=32)  # 8 GPUs each; the cluster has three machines of 8
    with pytest.raises(ValidationError) as refused:
        services.deployment_create(ask=too_many, user=operator)
    assert "3 of 4 copies fit" in str(refused.value) and "Deploy the copies that fit and queue the rest" in str(refused.value)
    assert not Deployment.objects.exists()

    deployment = services.deployment_create(ask=too_many, queue_rest=True, user=operator)
    states = list(deployment.copy_rows.values_list("state", "state_reason"))
    assert [s for s, _ in states].count(CopyState.SERVING) == 3
    queued = [r for s, r in states if s == CopyState.QUEUED]
    assert len(queued) == 1 and queued[0].startswith("Waiting for room: ")


def test_an_engine_that_exits_reads_failed_in_its_own_words(cluster, model, fakes, operator):
    fakes.answers = {name: {"copy_exited": {"*": "loading weights\nValueError: not enough memory"}}
                     for name in ("lab-a", "lab-b", "lab-c")}
    deployment = services.deployment_create(ask=ask(cluster, model, copies=1), user=operator)
    copy = deployment.copy_rows.get()
    assert copy.state == CopyState.FAILED and copy.state_reason == "ValueError: not enough memory"
    assert "loading weights" in copy.log_tail
    assert "not enough memory" in Job.objects.get(kind=serving.KIND).error


def test_delete_stops_the_copies_then_the_record_goes(cluster, model, fakes, operator):
    deployment = services.deployment_create(ask=ask(cluster, model), user=operator)
    deleted = services.deployment_delete(deployment=deployment, user=operator)
    assert deleted.job is not None
    assert sorted(kw["copy"] for _, m, kw in fakes.calls if m == "copy_stop") == [f"d{deployment.pk}-c1", f"d{deployment.pk}-c2"]
    assert not Deployment.objects.exists() and not Copy.objects.exists()


def test_delete_on_a_cluster_that_cannot_be_reached_goes_at_once_and_names_where_copies_run_on(cluster, model, fakes, operator):
    deployment = services.deployment_create(ask=ask(cluster, model, copies=1), user=operator)
    machine = deployment.copy_rows.get().machine.name
    cluster.members.update(state="down")
    deleted = services.deployment_delete(deployment=deployment, user=operator)
    assert deleted.job is None and deleted.left_on == (machine,)
    assert f"its copies on {machine} keep running without a deployment" in deleted.words
    assert not Deployment.objects.shown().exists()  # its copies run on without one (tests/unit/test_orphans.py)


def test_stop_keeps_the_deployment_and_start_applies_it_again(cluster, model, fakes, operator):
    deployment = services.deployment_create(ask=ask(cluster, model), user=operator)
    serving.cluster_stopping(cluster)
    assert set(deployment.copy_rows.values_list("state", flat=True)) == {CopyState.STOPPED}
    fakes.copies.clear()  # the runtime's stop ended the engines

    serving.cluster_running(cluster)
    assert set(deployment.copy_rows.values_list("state", flat=True)) == {CopyState.SERVING}
    assert len(starts(fakes)) == 4


@pytest.mark.parametrize("changes, field, words", [
    ({"name": "bad name!"}, "name", "A name clients use"),
    ({"copies": 9999}, "copies", "From 0 to 256"),
    ({"gpu_quarters": 3}, "gpu_quarters", "a quarter of a GPU, half a GPU"),
    ({"memory_per_gpu_mib": 90000}, "memory_per_gpu_mib", "at most the GPU's"),
    ({"gpu_quarters": 2, "memory_per_gpu_mib": 50000}, "memory_per_gpu_mib", "at most that share"),
    ({"context_length": 10**7}, "context_length", "from 16 to the model's 8,192 tokens"),
    ({"engine_options": ("--port=1",)}, "engine_options", "--port is set by the console"),
])
def test_a_bad_ask_is_refused_field_by_field_in_words(cluster, model, operator, changes, field, words):
    with pytest.raises(ValidationError) as refused:
        services.deployment_create(ask=ask(cluster, model, **changes), user=operator)
    assert words in " ".join(refused.value.message_dict[field])
    assert not Deployment.objects.exists()


def test_a_name_is_unique_across_clusters_a_viewer_may_not_deploy_and_a_stopped_cluster_is_refused(cluster, model, fakes, operator):
    services.deployment_create(ask=ask(cluster, model, copies=1), user=operator)
    other = cluster_of([gpu_machine("lab-d", 14)], name="other")
    with pytest.raises(ValidationError, match="named chat already"):
        services.deployment_create(ask=ask(other, model, copies=1), user=operator)
    with pytest.raises(PermissionDenied):
        services.deployment_create(ask=ask(other, model, name="x"), user=UserFactory(role=roles.VIEWER))
    other.state = ClusterState.STOPPED
    other.save()
    with pytest.raises(ValidationError, match="deployed on a running cluster"):
        services.deployment_create(ask=ask(other, model, name="y", copies=1), user=operator)


def test_the_form_suggests_the_kind_with_most_free_gpus_and_the_fewest_that_hold_the_model(cluster, model):
    suggestion = services.deployment_suggestion(cluster=cluster, model=model)
    assert suggestion["kind"].kind.model == "H100 80GB" and suggestion["kind"].arch == "x86_64"
    # 16 GiB of weights + 20 % = 19.2 GiB: a quarter of an H100 (19.9 GiB) holds it, and is given just that.
    assert suggestion["gpu_quarters"] == 1
    assert suggestion["memory_per_gpu_mib"] == 19661
    assert suggestion["context_length"] == 8192


# -- the health of serving copies ----------------------------------------------------------------------


def all_well(fakes, cluster) -> None:
    """Every machine's agent answers a healthy cluster (its runtime, Ray, and on the head Ray's node list)."""
    gcs = f"{cluster.head_address}:{cluster.ray_port}"
    for member in cluster.members.select_related("machine"):
        answer = {"runtime": {"state": "running", "ray": {"running": True, "gcs_address": gcs}}}
        if member.role == "head":
            nodes = [{"address": m.address, "alive": True, "gpus": 8} for m in cluster.members.all()]
            answer["ray"] = {"nodes": nodes, "alive_nodes": len(nodes), "gpus": 8 * len(nodes)}
        fakes.answers.setdefault(member.machine.name, {}).update(answer)


def test_a_copy_whose_engine_died_is_looked_at_twice_then_restarted_in_place_and_recorded(cluster, model, fakes, operator):
    from clusters import health
    from clusters.models import HealthCheck

    deployment = services.deployment_create(ask=ask(cluster, model, copies=1), user=operator)
    copy = deployment.copy_rows.get()
    all_well(fakes, cluster)
    fakes.answers[copy.machine.name]["copy_exited"] = {copy.key: "RuntimeError: CUDA error: an illegal memory access"}
    copy_machine, first_pid = copy.machine.name, copy.pid

    health.cluster_check_run(cluster_id=cluster.pk, trigger="schedule")

    copy.refresh_from_db()
    assert copy.state == CopyState.SERVING and copy.pid != first_pid
    stops = [kw["copy"] for name, m, kw in fakes.calls if m == "copy_stop"]
    assert stops == [copy.key]
    assert copy.restarts == 1
    repair = HealthCheck.objects.get(outcome="repair")
    assert "CUDA error" in repair.found[0]["text"] and f"Restarting {copy} on {copy_machine} (restart 1)" in repair.action
    assert len(starts(fakes)) == 2 and starts(fakes)[1][0] == copy_machine  # started again where it was
    looks = [m for name, m, _ in fakes.calls if m == "copy_list" and name == copy_machine]
    assert len(looks) >= 3  # the check's look, the second look, then the restarted copy's wait


def test_a_running_copy_that_answers_late_is_looked_at_again_and_restarted_only_after_the_grace(
        cluster, model, fakes, operator, settings, monkeypatch):
    from clusters import health
    from deployments import copy_health

    settings.FADEN_COPY_SILENT_GRACE = 30
    deployment = services.deployment_create(ask=ask(cluster, model, copies=1), user=operator)
    copy = deployment.copy_rows.get()
    all_well(fakes, cluster)
    fakes.answers[copy.machine.name]["copy_silent"] = {copy.key}
    looks = []
    monkeypatch.setattr(copy_health, "task_enqueue", lambda name, *args, **kw: looks.append(args))
    clock = [1000.0]
    monkeypatch.setattr(copy_health, "wall_clock", lambda: clock[0])

    health.cluster_check_run(cluster_id=cluster.pk, trigger="schedule")
    assert looks == [(copy.pk, 2, 1000.0)]  # looked at again, not restarted
    clock[0] = 1029.0
    assert copy_health.copy_look(copy.pk, look=2, unwell_since=1000.0) == (
        "unwell (Its engine does not answer its health check.): looking again")
    copy.refresh_from_db()
    assert copy.state == CopyState.SERVING and copy.restarts == 0 and not [c for c in fakes.calls if c[1] == "copy_stop"]

    clock[0] = 1031.0  # silent for longer than the grace: restarted in place
    assert copy_health.copy_look(copy.pk, look=3, unwell_since=1000.0).startswith("repaired")
    copy.refresh_from_db()
    assert copy.restarts == 1 and [kw["copy"] for _, m, kw in fakes.calls if m == "copy_stop"] == [copy.key]


def test_a_healthy_copy_is_left_alone_by_the_check(cluster, model, fakes, operator):
    from clusters import health

    deployment = services.deployment_create(ask=ask(cluster, model, copies=2), user=operator)
    all_well(fakes, cluster)
    health.cluster_check_run(cluster_id=cluster.pk, trigger="schedule")
    assert [m for _, m, _ in fakes.calls].count("copy_list") >= 2  # asked in the check's own session
    assert not [m for _, m, _ in fakes.calls if m == "copy_stop"]
    assert set(deployment.copy_rows.values_list("state", "restarts")) == {(CopyState.SERVING, 0)}


def test_a_copy_whose_machine_left_the_cluster_is_placed_on_another_with_room(cluster, model, fakes, operator):
    from deployments import copy_health

    deployment = services.deployment_create(ask=ask(cluster, model, copies=1), user=operator)
    copy = deployment.copy_rows.select_related("machine").get()
    member = cluster.members.get(machine=copy.machine)
    member.state, member.state_reason = "down", "Ray lost it."
    member.save()

    copy_health.copies_checked(cluster, {member.pk: {}})

    copy.refresh_from_db()
    assert copy.state == CopyState.SERVING and copy.machine_id != member.machine_id
    assert copy.restarts == 1
    from clusters.models import HealthCheck
    assert "Placing" in HealthCheck.objects.get(outcome="repair").action


def test_making_room_for_another_model_keeps_the_files_a_copy_on_the_machine_needs(cluster, model, fakes, operator):
    from deployments.store import machine_files

    deployment = services.deployment_create(ask=ask(cluster, model, copies=1), user=operator)
    member = cluster.members.get(machine=deployment.copy_rows.get().machine)
    other = ready_model("org/other", weight_bytes=10 * MiB)
    ModelFile.objects.create(model=other, path="w.safetensors", size=10 * MiB, sha256="3" * 64)
    fakes.answers[member.machine.name] = {"free_bytes": 1 * MiB}

    with pytest.raises(Exception, match="No model there can be removed to make room"):
        machine_files._make_disk_space(member, other)
    assert not [c for c in fakes.calls if c[1] == "model_remove"]


def test_a_copy_the_gateway_reports_is_looked_at_at_once_and_restarted_after_its_second_look(cluster, model, fakes, operator, settings):
    import json

    import redis

    from deployments import copy_health

    deployment = services.deployment_create(ask=ask(cluster, model, copies=1), user=operator)
    copy = deployment.copy_rows.select_related("machine").get()
    client = redis.Redis.from_url(settings.REDIS_URL)
    settings.FADEN_GATEWAY_REDIS_PREFIX = prefix = f"test-gw-{copy.pk}-{id(client)}"
    client.lpush(f"{prefix}:failed", json.dumps({"copy": copy.pk, "error": "Connection refused"}),
                 json.dumps({"copy": copy.pk, "error": "Connection refused"}))  # twice: looked at once
    fakes.answers[copy.machine.name] = {"copy_exited": {copy.key: "Killed"}}
    try:
        assert copy_health.gateway_failures() == 1
    finally:
        client.delete(f"{prefix}:failed")
    copy.refresh_from_db()
    assert copy.state == CopyState.SERVING and copy.restarts == 1
    assert [kw["copy"] for _, m, kw in fakes.calls if m == "copy_stop"] == [copy.key]


def test_machines_with_an_agent_too_old_for_copies_are_named_and_nothing_is_deployed(cluster, model, fakes, operator):
    cluster.members.get(machine__name="lab-b").machine.__class__.objects.filter(name="lab-b").update(agent_version="0.4.0")
    with pytest.raises(ValidationError, match=r"Deployments need agent 0.5.0 or newer on every machine; lab-b \(0.4.0\) runs"):
        services.deployment_create(ask=ask(cluster, model), user=operator)
    assert not Deployment.objects.exists()


def test_a_change_replaces_each_copy_with_a_new_one_serving_before_the_old_one_stops(cluster, model, fakes, operator):
    from deployments.asks import ask_of

    deployment = services.deployment_create(ask=ask(cluster, model, copies=2, gpu_quarters=4, memory_per_gpu_mib=30000),
                                            user=operator)
    services.deployment_change(deployment=deployment, ask=ask_of(deployment, context_length=2048), user=operator)

    order = [(method, kw["copy"]) for _, method, kw in fakes.calls if method in ("copy_start", "copy_stop")]
    key = lambda n: f"d{deployment.pk}-c{n}"  # noqa: E731
    assert sorted(order[:2]) == [("copy_start", key(1)), ("copy_start", key(2))]  # the deployment (started at once)
    assert order[2:] == [("copy_start", key(3)), ("copy_stop", key(1)), ("copy_start", key(4)), ("copy_stop", key(2))]
    assert list(deployment.copy_rows.values_list("number", "generation", "state")) == [
        (3, 2, CopyState.SERVING), (4, 2, CopyState.SERVING)]
    assert "--max-model-len" in starts(fakes)[-1][1]["argv"] and "2048" in starts(fakes)[-1][1]["argv"]


def test_a_replacement_that_cannot_be_placed_leaves_the_old_copy_serving_and_says_why(cluster, model, fakes, operator):
    from deployments.asks import ask_of

    deployment = services.deployment_create(ask=ask(cluster, model, copies=3, gpu_quarters=32), user=operator)
    services.deployment_change(deployment=deployment, ask=ask_of(deployment, context_length=2048), user=operator)
    assert list(deployment.copy_rows.values_list("generation", "state")) == [(1, CopyState.SERVING)] * 3
    job = Job.objects.filter(kind=serving.KIND).latest("created_at")
    assert "keeps serving: its replacement cannot be placed yet (no machine has 8 free H100 80GB" in job.error


def test_a_resumed_apply_starts_a_copy_its_dead_worker_left_starting_before_the_machine_was_asked(
        cluster, model, fakes, operator):
    """The worker died between the copy's Starting and its machine's start: the machine lists no engine, the
    row no pid. The job taken up again starts it (it does not read Failed, which no check repairs: a drain
    waiting on it as a replacement would wait until it is called stuck)."""
    from deployments.tasks import deployment_apply
    from tests.factories import JobFactory

    deployment = services.deployment_create(ask=ask(cluster, model, copies=2), user=operator)
    lost, kept = deployment.copy_rows.order_by("number")
    fakes.copies[lost.machine.name].pop(lost.key)
    Copy.objects.filter(pk=lost.pk).update(state=CopyState.STARTING, pid=None)
    job = JobFactory(kind=serving.KIND, state="queued", resumes=1, target_type="deployment", target_id=deployment.pk,
                     steps=[{"name": name, "state": "pending", "detail": ""} for name in serving.APPLY.step_names])

    deployment_apply(job.pk)

    lost.refresh_from_db()
    assert lost.state == CopyState.SERVING, lost.state_reason
    assert lost.pid == fakes.copies[lost.machine.name][lost.key]["pid"]
    assert [kw["copy"] for _, kw in starts(fakes)].count(lost.key) == 2  # its first start, then this one
    assert Copy.objects.get(pk=kept.pk).pid == kept.pid  # the serving copy is left alone
    job.refresh_from_db()
    assert job.state == "succeeded", job.log
