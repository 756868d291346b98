"""Models running without a deployment, with fake agents: a delete that cannot stop its copies leaves them
running without a deployment (counted by placement, routed by the gateway, listed on the cluster's page only);
Look for them finds them and the engines no record knows; Take over keeps them as they run or deletes them
properly; the card and who may press its buttons."""
import pytest
from django.core.exceptions import PermissionDenied, ValidationError
from django.test import Client

from console import roles
from console.choices import ErrorKind, JobState
from console.models import Job
from deployments import orphans, placement_input, services, serving
from deployments.choices import CopyState
from deployments.models import Copy, Deployment, ModelHolding
from deployments.selectors import deployments_list
from tests.builders import cluster_of, gpu_machine, ready_model
from tests.factories import UserFactory
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # copies start from a pool of threads

H100_MIB = 81559


@pytest.fixture
def operator():
    return UserFactory(role=roles.OPERATOR)


@pytest.fixture
def model():
    return ready_model("org/chat", weight_bytes=16 * 2**30)


@pytest.fixture
def cluster():
    return cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12), gpu_machine("lab-c", 13)])


@pytest.fixture
def fakes(monkeypatch):
    return FakeAgents().install(monkeypatch)


def deploy(cluster, model, operator, name="chat", copies=2):
    return services.deployment_create(ask=services.DeployAsk(
        cluster=cluster, model=model, name=name, copies=copies, gpu_quarters=8, vendor="nvidia",
        gpu_model="NVIDIA H100 80GB HBM3", gpu_memory_mib=H100_MIB, arch="x86_64", memory_per_gpu_mib=70000,
        context_length=4096), user=operator)


def cut(fakes, *names):
    for name in names:
        fakes.answers.setdefault(name, {})["error"] = "ssh: connect to host: No route to host"


def heal(fakes, *names):
    for name in names:
        fakes.answers.get(name, {}).pop("error", None)


def orphaned_by_a_cut(cluster, model, operator, fakes) -> Deployment:
    deployment = deploy(cluster, model, operator)
    cut(fakes, "lab-a", "lab-b", "lab-c")
    services.deployment_delete(deployment=deployment, user=operator)
    heal(fakes, "lab-a", "lab-b", "lab-c")
    return Deployment.objects.get(pk=deployment.pk)


def held_gpus(cluster) -> int:
    return sum(1 for room in placement_input.cluster_rooms(cluster) for gpu in room.gpus if gpu.share_taken)


def test_a_delete_that_cannot_reach_the_machines_leaves_its_copies_running_without_a_deployment(cluster, model, fakes, operator):
    deployment = deploy(cluster, model, operator)
    pids = dict(deployment.copy_rows.values_list("number", "pid"))
    cut(fakes, "lab-a", "lab-b", "lab-c")
    services.deployment_delete(deployment=deployment, user=operator)

    job = Job.objects.get(kind=serving.DELETE_KIND)
    assert job.state == JobState.FAILED and job.error_kind == ErrorKind.NOT_RETRYABLE
    assert "run without a deployment" in job.error and "Models running here without a deployment" in job.error
    deployment.refresh_from_db()
    assert deployment.orphaned_at is not None and deployment.deleting_since is None
    # Their GPUs stay held, the gateway still routes the name to them, and they are no deployment any more.
    assert set(deployment.copy_rows.values_list("state", flat=True)) == {CopyState.SERVING}
    assert dict(deployment.copy_rows.values_list("number", "pid")) == pids
    assert held_gpus(cluster) == 4
    assert deployments_list() == []
    assert [o.name for o in orphans.orphans_of(cluster)] == ["chat"]
    with pytest.raises(ValidationError, match="without a deployment answers under chat"):
        deploy(cluster, model, operator)


def test_a_delete_on_a_cluster_that_cannot_be_reached_leaves_the_copies_without_a_deployment_and_says_so(
        cluster, model, fakes, operator):
    deployment = deploy(cluster, model, operator, copies=1)
    machine = deployment.copy_rows.get().machine.name
    cluster.members.update(state="down")
    deleted = services.deployment_delete(deployment=deployment, user=operator)
    assert deleted.job is None and deleted.left_on == (machine,)
    assert f"its copies on {machine} keep running without a deployment" in deleted.words
    assert Deployment.objects.get(pk=deployment.pk).orphaned
    assert held_gpus(cluster) == 2


def test_a_delete_the_reaper_gives_up_on_leaves_its_copies_without_a_deployment(cluster, model, fakes, operator):
    deployment = deploy(cluster, model, operator)
    Deployment.objects.filter(pk=deployment.pk).update(deleting_since="2026-12-06T00:00Z")
    deployment.copy_rows.update(state=CopyState.STOPPING)
    serving.delete_abandoned(Job(target_id=deployment.pk))
    deployment.refresh_from_db()
    assert deployment.orphaned and set(deployment.copy_rows.values_list("state", flat=True)) == {CopyState.SERVING}


def test_look_for_them_finds_the_copies_and_the_engines_no_record_knows(cluster, model, fakes, operator):
    deployment = orphaned_by_a_cut(cluster, model, operator, fakes)
    holding = ModelHolding.objects.filter(model=model).first()
    lab_c = cluster.members.get(machine__name="lab-c")
    # An engine started by a console whose record is gone, without a key of its own, and one with a key.
    argv = ["vllm", "serve", holding.path, "--served-model-name", "old-chat", "--host", lab_c.address, "--port", "8150",
            "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.4000", "--max-model-len", "2048"]
    ModelHolding.objects.get_or_create(model=model, machine=lab_c.machine, defaults={"path": holding.path})
    fakes.copies.setdefault("lab-c", {})["d999-c1"] = {
        "pid": 4242, "port": 8150, "argv": argv, "env": {"CUDA_VISIBLE_DEVICES": "5"}, "cluster": cluster.name,
        "address": lab_c.address, "started_at": 1_700_000_000.0}
    fakes.copies["lab-c"]["d998-c1"] = {
        "pid": 4243, "port": 8151, "argv": [*argv[:4], "keyed", *argv[5:]], "cluster": cluster.name,
        "env": {"CUDA_VISIBLE_DEVICES": "6", "VLLM_API_KEY": "x"}, "address": lab_c.address, "started_at": 1_700_000_001.0}

    job = orphans.orphans_look_start(cluster=cluster, user=operator)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.error
    assert "3 models running without a deployment" in job.steps[0]["detail"]
    found = {o.name: o for o in orphans.orphans_of(cluster)}
    assert set(found) == {"chat", "old-chat", "keyed"}
    assert found["chat"].known and len(found["chat"].engines) == 2
    old = found["old-chat"]
    assert not old.known and old.model == str(model) and old.keep_refusal is None
    assert [(e["machine_name"], e["gpus"], e["port"], e["pid"]) for e in old.engines] == [("lab-c", [5], 8150, 4242)]
    assert old.since.startswith("2023-11-14")
    assert "its own key, which the console no longer holds" in found["keyed"].keep_refusal
    assert not orphans.take_offer(cluster, found["keyed"], keep=True, role=roles.OPERATOR).ok
    assert orphans.take_offer(cluster, found["keyed"], keep=False, role=roles.OPERATOR).ok
    assert deployment.copy_rows.count() == 2


def test_keep_makes_it_a_deployment_again_with_the_same_processes(cluster, model, fakes, operator):
    deployment = orphaned_by_a_cut(cluster, model, operator, fakes)
    pids = dict(deployment.copy_rows.values_list("number", "pid"))
    started = len([c for c in fakes.calls if c[1] == "copy_start"])

    job = orphans.orphan_take_over(cluster=cluster, name="chat", keep=True, user=operator)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.error
    deployment.refresh_from_db()
    assert not deployment.orphaned and deployment.copies == 2
    assert dict(deployment.copy_rows.values_list("number", "pid")) == pids
    assert set(deployment.copy_rows.values_list("state", flat=True)) == {CopyState.SERVING}
    assert len([c for c in fakes.calls if c[1] == "copy_start"]) == started  # nothing restarted
    assert [d.name for d in deployments_list()] == ["chat"] and orphans.orphans_of(cluster) == []


def test_an_engine_left_on_a_machine_its_copy_moved_off_while_it_was_away_is_found_and_deleted_there_only(
        cluster, model, fakes, operator):
    """lab-b went offline, its copy was placed on lab-c; lab-b comes back with the old engine still running under
    the copy's id. It is no copy's (the record places it on lab-c): Look for them lists it, it cannot be kept
    (its key went with the copy), and Delete it properly stops lab-b's engine alone."""
    deployment = deploy(cluster, model, operator)
    moved = deployment.copy_rows.get(machine__name="lab-b")
    stale = dict(fakes.copies["lab-b"][moved.key])
    lab_c = cluster.members.get(machine__name="lab-c").machine
    Copy.objects.filter(pk=moved.pk).update(machine=lab_c, slots=[moved.slots[0] | {"machine": lab_c.pk}])
    fakes.copies.setdefault("lab-c", {})[moved.key] = stale | {"pid": 777}

    job = orphans.orphans_look_start(cluster=cluster, user=operator)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.error
    [found] = orphans.orphans_of(cluster)
    assert (found.name, found.known, [(e["machine_name"], e["pid"]) for e in found.engines]) == (
        "chat", False, [("lab-b", stale["pid"])])
    assert found.keep_refusal and not orphans.take_offer(cluster, found, keep=True, role=roles.OPERATOR).ok

    gone = orphans.orphan_take_over(cluster=cluster, name="chat", keep=False, user=operator)

    gone.refresh_from_db()
    assert gone.state == JobState.SUCCEEDED, gone.error
    assert [(name, kw["copy"]) for name, method, kw in fakes.calls if method == "copy_stop"] == [("lab-b", moved.key)]
    assert moved.key not in fakes.copies["lab-b"] and fakes.copies["lab-c"][moved.key]["pid"] == 777
    assert deployment.copy_rows.count() == 2


def test_delete_properly_stops_the_engines_and_frees_the_gpus(cluster, model, fakes, operator):
    deployment = orphaned_by_a_cut(cluster, model, operator, fakes)
    keys = {c.key for c in deployment.copy_rows.all()}
    assert held_gpus(cluster) == 4

    job = orphans.orphan_take_over(cluster=cluster, name="chat", keep=False, user=operator)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.error
    assert not Deployment.objects.filter(pk=deployment.pk).exists()
    assert {kw["copy"] for _, method, kw in fakes.calls if method == "copy_stop"} >= keys
    assert held_gpus(cluster) == 0
    assert not any(fakes.copies.get(name) for name in ("lab-a", "lab-b", "lab-c"))


def test_an_engine_no_record_knows_is_kept_from_what_its_agent_reports_under_its_own_id(cluster, model, fakes, operator):
    deploy(cluster, model, operator, name="other", copies=1)
    holding = ModelHolding.objects.filter(model=model).first()
    lab_c = cluster.members.get(machine__name="lab-c")
    ModelHolding.objects.get_or_create(model=model, machine=lab_c.machine, defaults={"path": holding.path})
    argv = ["vllm", "serve", holding.path, "--served-model-name", "old-chat", "--host", lab_c.address, "--port", "8150",
            "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.8000", "--max-model-len", "2048"]
    fakes.copies.setdefault("lab-c", {})["d999-c1"] = {
        "pid": 4242, "port": 8150, "argv": argv, "env": {"CUDA_VISIBLE_DEVICES": "4,5"}, "cluster": cluster.name,
        "address": lab_c.address, "started_at": 1_700_000_000.0}
    orphans.orphans_look_start(cluster=cluster, user=operator)

    job = orphans.orphan_take_over(cluster=cluster, name="old-chat", keep=True, user=operator)

    job.refresh_from_db()
    assert job.state == JobState.SUCCEEDED, job.error
    kept = Deployment.objects.get(name="old-chat")
    assert (kept.model, kept.gpu_quarters, kept.context_length, kept.memory_per_gpu_mib) == (model, 8, 2048, int(H100_MIB * 0.8))
    copy = kept.copy_rows.get()
    assert (copy.key, copy.pid, copy.port, copy.state) == ("d999-c1", 4242, 8150, CopyState.SERVING)
    assert copy.slots == [{"machine": lab_c.machine_id, "gpus": [4, 5], "quarters": 4, "port": 8150}]
    assert orphans.orphans_of(cluster) == []
    # It is the deployment's own copy now: a delete stops it by the id its machine knows.
    services.deployment_delete(deployment=kept, user=operator)
    assert "d999-c1" not in fakes.copies["lab-c"]


def test_an_engine_whose_machine_does_not_say_its_gpus_is_only_deleted_and_the_card_says_why(cluster, model, fakes, operator):
    lab_c = cluster.members.get(machine__name="lab-c")
    fakes.copies.setdefault("lab-c", {})["d7-c1"] = {
        "pid": 77, "port": 8150, "argv": ["vllm", "serve", "/models/x", "--served-model-name", "ghost"], "env": {},
        "cluster": cluster.name, "address": lab_c.address, "started_at": None}
    orphans.orphans_look_start(cluster=cluster, user=operator)
    [ghost] = orphans.orphans_of(cluster)
    assert "does not say which GPUs it runs on" in ghost.keep_refusal
    with pytest.raises(ValidationError, match="ghost cannot be kept"):
        orphans.orphan_take_over(cluster=cluster, name="ghost", keep=True, user=operator)

    job = orphans.orphan_take_over(cluster=cluster, name="ghost", keep=False, user=operator)

    assert Job.objects.get(pk=job.pk).state == JobState.SUCCEEDED
    assert "d7-c1" not in fakes.copies["lab-c"] and orphans.orphans_of(cluster) == []


def test_copies_the_look_does_not_find_are_gone_and_so_is_the_model_once_none_is_left(cluster, model, fakes, operator):
    deployment = orphaned_by_a_cut(cluster, model, operator, fakes)
    for name in ("lab-a", "lab-b", "lab-c"):
        fakes.copies.get(name, {}).clear()  # the machines rebooted meanwhile
    orphans.orphans_look_start(cluster=cluster, user=operator)
    assert not Deployment.objects.filter(pk=deployment.pk).exists()
    assert held_gpus(cluster) == 0


def test_copies_of_a_machine_the_look_cannot_ask_are_left_as_they_are_and_the_machine_is_named(cluster, model, fakes, operator):
    deployment = orphaned_by_a_cut(cluster, model, operator, fakes)
    cut(fakes, "lab-a", "lab-b")
    job = orphans.orphans_look_start(cluster=cluster, user=operator)
    job.refresh_from_db()
    assert deployment.copy_rows.count() == 2
    assert sorted(n.split(":")[0] for n in job.params["not_asked"]) == ["lab-a", "lab-b"]


def test_a_viewer_may_not_look_or_take_over_and_one_job_runs_at_a_time(cluster, model, fakes, operator):
    orphaned_by_a_cut(cluster, model, operator, fakes)
    viewer = UserFactory(role=roles.VIEWER)
    with pytest.raises(PermissionDenied, match="needs an Operator"):
        orphans.orphans_look_start(cluster=cluster, user=viewer)
    with pytest.raises(PermissionDenied):
        orphans.orphan_take_over(cluster=cluster, name="chat", keep=False, user=viewer)
    Job.objects.create(kind=orphans.LOOK_KIND, title="Look for models", target_type=orphans.TARGET, target_id=cluster.pk,
                       state=JobState.RUNNING)
    with pytest.raises(ValidationError, match="under way"):
        orphans.orphan_take_over(cluster=cluster, name="chat", keep=True, user=operator)
    with pytest.raises(ValidationError, match="No model runs"):
        Job.objects.filter(target_type=orphans.TARGET).delete()
        orphans.orphan_take_over(cluster=cluster, name="nothing", keep=False, user=operator)


def test_a_cluster_stopped_meanwhile_keeps_no_model_but_may_delete_it(cluster, model, fakes, operator):
    orphaned_by_a_cut(cluster, model, operator, fakes)
    cluster.state = "stopped"
    cluster.save(update_fields=["state"])
    [orphan] = orphans.orphans_of(cluster)
    assert "a model is kept on a running cluster only" in orphans.take_offer(cluster, orphan, keep=True, role=roles.OPERATOR).why
    assert orphans.take_offer(cluster, orphan, keep=False, role=roles.OPERATOR).ok


def test_the_cluster_page_lists_them_with_the_buttons_for_an_operator_only(cluster, model, fakes, operator):
    orphaned_by_a_cut(cluster, model, operator, fakes)
    client = Client()
    client.force_login(operator)
    page = client.get(f"/clusters/{cluster.pk}/").content.decode()
    card = page[page.index('id="cluster-orphans"'):]
    card = card[:card.index("</section>")]
    assert "Models running here without a deployment" in card and "chat" in card
    assert f'formaction="/deployments/clusters/{cluster.pk}/orphans/look/"' in card
    assert f'formaction="/deployments/clusters/{cluster.pk}/orphans/keep/" name="name" value="chat"' in card
    # The models card no longer lists it as a deployment.
    models = page[page.index('id="cluster-models"'):]
    assert "No models are deployed on this cluster yet." in models[:models.index("</section>")]

    response = client.post(f"/deployments/clusters/{cluster.pk}/orphans/delete/", {"name": "chat"})
    assert response.status_code == 302 and not Deployment.objects.exists()

    viewer = Client()
    viewer.force_login(UserFactory(role=roles.VIEWER))
    card = viewer.get(f"/clusters/{cluster.pk}/").content.decode()
    card = card[card.index('id="cluster-orphans"'):]
    assert "formaction" not in card[:card.index("</section>")]
    assert viewer.post(f"/deployments/clusters/{cluster.pk}/orphans/look/").status_code == 403


def test_the_card_is_pushed_alone_as_its_jobs_move(cluster, model, fakes, operator):
    from clusters.pages import render_cluster_topic

    orphaned_by_a_cut(cluster, model, operator, fakes)
    [html] = render_cluster_topic(str(cluster.pk), orphans.LIVE_PART, roles.OPERATOR)
    assert 'id="cluster-orphans" class="card" hx-swap-oob="true"' in html and "chat" in html


def test_a_cluster_with_a_model_running_without_a_deployment_is_not_deleted(cluster, model, fakes, operator):
    from clusters import hooks

    orphaned_by_a_cut(cluster, model, operator, fakes)
    assert "1 model still runs on gpu-room without a deployment" in hooks.delete_refusal(cluster)


def engine(**changes) -> dict:
    """An engine as a look keeps it: tiny on GPU 3 of lab-c, started without a key of its own."""
    argv = ["vllm", "serve", "/var/lib/fadenstack/models/org--chat/main", "--served-model-name", "tiny", "--host",
            "198.18.1.13", "--port", "8100", "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.2000",
            "--max-model-len", "2048"]
    return {"machine": 3, "machine_name": "lab-c", "copy": "d9-c1", "cluster": "gpu-room", "pid": 50, "port": 8100,
            "address": "198.18.1.13", "since": None, "running": True, "healthy": True, "gpus": [3], "argv": argv,
            "env_names": ["CUDA_VISIBLE_DEVICES"], "name": "tiny", "model_dir": argv[2], "nodes": []} | changes


@pytest.mark.parametrize("changes, words", [
    ({"nodes": [4]}, "runs over several machines"),
    ({"env_names": ["CUDA_VISIBLE_DEVICES", "VLLM_API_KEY"]}, "its own key"),
    ({"gpus": None}, "does not say which GPUs"),
    ({"running": False}, "is not running"),
    ({"argv": ["vllm", "serve", "/m", "--gpu-memory-utilization", "lots"], "model_dir": "/m"}, "share of GPU memory"),
])
def test_an_engine_that_does_not_tell_all_a_deployment_needs_is_only_deleted_and_why(changes, words):
    from deployments import orphan_engines

    facts, refusal = orphan_engines.shape([engine(**changes)])
    assert facts is None and words in refusal


def test_what_a_kept_engine_becomes_is_read_from_its_command_line():
    from deployments import orphan_engines

    assert orphan_engines.shape([engine()]) == ({"model_dir": "/var/lib/fadenstack/models/org--chat/main", "gpus": 1,
                                                 "memory_fraction": 0.2, "context_length": 2048, "gpu_quarters": 1,
                                                 "tls": False}, None)
    two = engine(gpus=[0, 1], argv=[*engine()["argv"][:10], "2", *engine()["argv"][11:]])
    assert orphan_engines.shape([two])[0]["gpu_quarters"] == 8
    assert "do not all run the same model the same way" in orphan_engines.shape([engine(), two])[1]
    assert [*orphan_engines.grouped([engine(copy="d9-c2"), engine(), engine(name="other")])] == ["other", "tiny"]


def test_a_model_running_without_a_deployment_is_not_deleted_from_the_store(cluster, model, fakes, operator):
    from deployments.store.actions import model_delete_refusal

    orphaned_by_a_cut(cluster, model, operator, fakes)
    assert model_delete_refusal(model) == ("org/chat runs without a deployment as chat on gpu-room: take it over on the "
                                           "cluster's page first.")
