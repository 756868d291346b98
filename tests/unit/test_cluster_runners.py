"""The jobs of a cluster run end to end against the fake agent client: a start ships the image
server-first then machine to machine, keeps one transfer per machine and file, and the cluster reads
Running only in the transaction that ends its job."""
import time

import pytest
from django.core import signing

from clusters import services, steps, tasks
from clusters.choices import ClusterState, MemberState
from clusters.models import Cluster, Transfer
from console import live
from console.choices import JobState
from console.jobs import JobContext, job_create, job_run
from console.models import Job
from machines.models import Machine
from tests.builders import build, cluster_of, gpu_machine
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # the job's threads read the database on their own connections


def node(host: int) -> dict:
    return {"address": f"198.18.1.{host}", "alive": True, "gpus": 8, "node_id": f"node-{host}"}


@pytest.fixture
def stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(live, "push", lambda *args, **kwargs: None)
    monkeypatch.setattr(tasks.cluster_check, "apply_async", lambda *args, **kwargs: None)
    image = build("2.1.0")
    held = tmp_path / "runtime.img"
    held.write_bytes(b"x" * image.size_bytes)
    image.path, image.chunk_hashes = str(held), ["c" * 64]
    image.save()
    machines = [gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12), gpu_machine("gpu-c", 13)]
    return cluster_of(machines, runtime=image, state=ClusterState.STOPPED)


@pytest.fixture
def agents(monkeypatch):
    fakes = FakeAgents({"gpu-a": {"ray": {"alive_nodes": 3, "gpus": 24, "nodes": [node(11), node(12), node(13)]}}})
    return fakes.install(monkeypatch)


def start(cluster: Cluster) -> Job:
    job = services.cluster_start(cluster=cluster)
    tasks.cluster_job(job.pk)
    return Job.objects.get(pk=job.pk)


def test_a_start_reads_running_only_once_its_job_has_ended(stopped, agents):
    seen_while_checking = []
    agents.on_ray_status = lambda: seen_while_checking.append(
        (Cluster.objects.get(pk=stopped.pk).state, Job.objects.get(kind=steps.START.kind).state))

    job = start(stopped)

    assert job.state == JobState.SUCCEEDED, job.error
    assert seen_while_checking == [(ClusterState.STARTING, JobState.RUNNING)]
    cluster = Cluster.objects.get(pk=stopped.pk)
    assert cluster.state == ClusterState.RUNNING
    assert set(cluster.members.values_list("state", flat=True)) == {MemberState.JOINED}


def test_the_image_leaves_the_server_once_and_travels_machine_to_machine(stopped, agents):
    start(stopped)

    fetched = {name: kwargs["url"] for name, method, kwargs in agents.calls if method == "file_fetch"}  # threads: any order
    digest = stopped.members.first().runtime_image.digest
    assert fetched == {"gpu-a": f"https://198.18.0.1:8443/agent/images/{digest}/",  # TLS to the pinned certificate
                       "gpu-b": f"http://198.18.1.11:7470/blobs/{digest}", "gpu-c": f"http://198.18.1.12:7470/blobs/{digest}"}
    transfers = {t.member.machine.name: t for t in Transfer.objects.select_related("member__machine")}
    assert transfers["gpu-a"].source == "the server" and transfers["gpu-c"].source == "gpu-b (198.18.1.12)"
    assert all(t.complete and t.what == "the runtime image" for t in transfers.values())


def test_the_first_copy_s_token_is_the_machine_s_own_for_its_cluster_and_lasts_as_long_as_the_fetch(stopped, agents):
    from clusters import images

    started = time.time()
    start(stopped)

    [(name, fetch)] = [(name, kwargs) for name, method, kwargs in agents.calls if method == "file_fetch" and "/blobs/" not in kwargs["url"]]
    granted = signing.loads(fetch["token"], salt=images.TOKEN_SALT)
    assert name == "gpu-a"
    assert granted["digest"] == fetch["digest"] and granted["cluster"] == stopped.pk
    assert granted["machine"] == Machine.objects.get(name="gpu-a").pk
    assert started + fetch["timeout"] - 1 <= granted["expires"] <= time.time() + fetch["timeout"]
    assert fetch["timeout"] < 3600  # a 1 KiB image: minutes, not the day tokens used to last


def test_a_start_that_a_stop_overtook_after_its_last_step_leaves_the_stop_s_word(stopped, agents):
    def stop_now():
        Cluster.objects.filter(pk=stopped.pk).update(state=ClusterState.STOPPING)

    agents.on_ray_status = stop_now

    job = start(stopped)

    assert job.state == JobState.SUCCEEDED
    assert Cluster.objects.get(pk=stopped.pk).state == ClusterState.STOPPING


def test_what_a_job_leaves_for_its_success_is_not_written_when_it_fails():
    job = job_create(kind="test.finish", title="t", target_type="test", target_id=1, steps=["one"])
    written = []

    def work(ctx: JobContext) -> None:
        ctx.on_success(lambda: written.append("done"))
        raise RuntimeError("broke")

    assert job_run(job.pk, work, on_change=lambda j: None).state == JobState.FAILED
    assert written == []


def test_a_finisher_that_breaks_fails_the_job_instead_of_leaving_it_running():
    job = job_create(kind="test.finish", title="t", target_type="test", target_id=1, steps=["one"])

    def work(ctx: JobContext) -> None:
        ctx.on_success(lambda: 1 / 0)

    ended = job_run(job.pk, work, on_change=lambda j: None)

    assert (ended.state, ended.error) == (JobState.FAILED, "Unexpected error: division by zero")
    assert Job.objects.get(pk=job.pk).state == JobState.FAILED


def test_a_machine_with_another_agent_stops_the_start_before_anything_moves_and_says_to_refresh_it(stopped, agents):
    Machine.objects.filter(name="gpu-b").update(agent_version="0.1.0")

    job = start(stopped)

    cluster = Cluster.objects.get(pk=stopped.pk)
    assert job.state == JobState.FAILED and job.error_kind == "not_retryable"
    assert cluster.state == ClusterState.WAITING
    assert "gpu-b runs another agent than this console's" in cluster.state_reason
    assert "select Refresh facts on its page, then Try again" in cluster.state_reason
    assert agents.calls == []  # nothing reached a machine


def test_several_files_travel_each_in_its_own_chain_with_a_bar_per_machine_and_file(stopped, agents):
    from clusters.fanout import ProgressBoard
    from clusters.selectors import cluster_members
    from clusters.transfer import ServerFile, distribute
    from machines.agent_client import FileSpec

    files = [ServerFile(spec=FileSpec(digest=d * 64, size=size, chunk_size=size, chunk_hashes=["c" * 64]), what=what,
                        download_path=f"/agent/files/{d * 64}/", token=lambda lifetime: "t")
             for d, size, what in (("a", 100, "the runtime image"), ("b", 300, "the model's weights"))]
    stopped.members.update(state=MemberState.PENDING)  # as a start leaves them before the files travel
    members = cluster_members(stopped)
    ctx = JobContext(job_create(kind="test.files", title="t", target_type="cluster", target_id=stopped.pk, steps=["files"]),
                     on_change=lambda j: None)

    with ProgressBoard(stopped) as board:
        got = distribute(ctx, stopped, members, members[0], board, lambda member: files)

    assert len(got) == 3
    bars = {(t.member.machine.name, t.what): (t.source, t.bytes_done, t.bytes_total)
            for t in Transfer.objects.select_related("member__machine")}
    for what, size in (("the runtime image", 100), ("the model's weights", 300)):
        assert bars[("gpu-a", what)] == ("the server", size, size)
        assert bars[("gpu-b", what)] == ("gpu-a (198.18.1.11)", size, size)
        assert bars[("gpu-c", what)] == ("gpu-b (198.18.1.12)", size, size)
    server_copies = [call for call in agents.calls if call[1] == "file_fetch" and "/agent/files/" in call[2]["url"]]
    assert len(server_copies) == 2  # one per file, whatever the number of machines


def test_a_machine_that_joined_but_shows_in_the_head_s_list_a_moment_later_is_up(stopped, agents, monkeypatch):
    from clusters.runners import start as runner

    monkeypatch.setattr(runner, "RAY_LIST_PAUSE", 0)
    listed = agents.answers["gpu-a"]["ray"]
    full = list(listed["nodes"])
    listed["nodes"] = full[:2]  # gpu-c joined, but the head's list does not hold it yet
    looks = []

    def look():
        looks.append(1)
        if len(looks) == 2:
            listed["nodes"] = full

    agents.on_ray_status = look

    job = start(stopped)

    assert job.state == JobState.SUCCEEDED and len(looks) == 2
    assert set(Cluster.objects.get(pk=stopped.pk).members.values_list("state", flat=True)) == {MemberState.JOINED}


def test_a_join_whose_node_list_holds_every_machine_alive_is_the_check_without_asking_ray_again(stopped, agents):
    agents.answers["gpu-c"] = {"ray_started": agents.answers["gpu-a"]["ray"]}  # the last join saw all three alive
    asked = []
    agents.on_ray_status = lambda: asked.append(1)

    job = start(stopped)

    assert job.state == JobState.SUCCEEDED, job.error
    assert asked == []
    assert set(Cluster.objects.get(pk=stopped.pk).members.values_list("state", flat=True)) == {MemberState.JOINED}
    assert Cluster.objects.get(pk=stopped.pk).members.get(machine__name="gpu-c").ray_node_id


def test_each_machine_loads_and_starts_its_runtime_with_its_driver_and_the_cluster_s_name(stopped, agents):
    Machine.objects.filter(name="gpu-b").update(container_runtime="podman", runtime_choice="podman")
    Machine.objects.filter(name="gpu-c").update(container_runtime="process", configured_runtime="process")

    assert start(stopped).state == JobState.SUCCEEDED

    loads = {name: kwargs["driver"] for name, method, kwargs in agents.calls if method == "image_load"}
    starts = {name: (kwargs["driver"], kwargs["cluster"]) for name, method, kwargs in agents.calls if method == "runtime_start"}
    assert loads == {"gpu-a": "docker", "gpu-b": "podman", "gpu-c": "process"}
    assert starts == {"gpu-a": ("docker", "gpu-room"), "gpu-b": ("podman", "gpu-room"), "gpu-c": ("process", "gpu-room")}


def test_a_head_that_lost_its_runtime_since_it_was_picked_stops_the_start_with_the_sentence(stopped, agents):
    Machine.objects.filter(name="gpu-a").update(container_runtime="", container_runtimes=[])

    job = start(stopped)

    assert job.state == JobState.FAILED and job.error_kind == "not_retryable"
    assert job.error == "No container runtime on gpu-a: install Docker or Podman"
    assert not [call for call in agents.calls if call[1] in ("image_load", "runtime_start")]


def test_a_worker_that_lost_its_runtime_sits_the_start_out_and_says_why(stopped, agents):
    Machine.objects.filter(name="gpu-c").update(container_runtime="", container_runtimes=[])
    agents.answers["gpu-a"]["ray"]["nodes"] = [node(11), node(12)]  # it never joined

    start(stopped)

    member = Cluster.objects.get(pk=stopped.pk).members.get(machine__name="gpu-c")
    assert (member.state, member.state_reason) == (MemberState.FAILED, "No container runtime on gpu-c: install Docker or Podman")
    assert "gpu-c" not in {name for name, method, _ in agents.calls if method == "runtime_start"}
