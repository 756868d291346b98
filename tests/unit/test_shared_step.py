"""/shared in a cluster's life (clusters/runners/shared.py, clusters/shared_files.py), against the fake agent
client: a start exports it on the head and mounts it on the others with the method every machine can do,
a join keeps the cluster's method, a machine that cannot is left out and named, a delete unmounts it
everywhere before the node settings go and says the head keeps its files; the Connect card says which
method the cluster uses."""
from datetime import timedelta

import pytest
from django.utils import timezone

from clusters import pages, services, steps
from clusters.choices import ClusterState, MemberState
from clusters.models import Cluster
from clusters.runners import shared as shared_runner
from clusters.runners.shared import SHARED_AGENT
from clusters.shared_files import Abilities, shared_method, shared_sentence
from console import roles
from console.choices import JobState, StepState
from machines.agent import agent_version
from machines.choices import MachineState
from machines.models import Machine
from machines.versions import agent_outdated
from tests.builders import cluster_of, gpu_machine
from tests.factories import JobFactory
from tests.cluster_jobs import agents, image, node, quiet, run, step_of  # noqa: F401 (fixtures)
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # the job's threads read the database on their own connections

NO_SSHFS = "sshfs is not installed (apt-get install sshfs)"
NFS_HEAD = {"shared_can": {"nfs_export": True, "nfs_mount": True}}


@pytest.fixture
def stopped(image):
    return cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12), gpu_machine("gpu-c", 13)], runtime=image,
                      state=ClusterState.STOPPED)




def calls_to(agents: FakeAgents, method: str) -> list[tuple[str, dict]]:
    return sorted((name, kwargs) for name, called, kwargs in agents.calls if called == method)


def shared_of(cluster: Cluster) -> dict:
    return Cluster.objects.get(pk=cluster.pk).shared_files


# -- the choice (pure) ----------------------------------------------------------------------------------------


def able(nfs_export=False, nfs_mount=False, sshfs=True) -> Abilities:
    cannot = {} if sshfs else {"sshfs": NO_SSHFS}
    return Abilities(can={"nfs_export": nfs_export, "nfs_mount": nfs_mount, "sshfs": sshfs}, cannot=cannot)


def test_nfs_is_chosen_when_the_head_exports_and_every_node_mounts_nfs():
    choice = shared_method("a", {"a": able(nfs_export=True), "b": able(nfs_mount=True), "c": able(nfs_mount=True, sshfs=False)})

    assert (choice.method, choice.mount_on, dict(choice.left_out)) == ("nfs", ("b", "c"), {})


def test_sshfs_is_chosen_when_one_node_cannot_mount_nfs_and_every_node_has_sshfs():
    choice = shared_method("a", {"a": able(nfs_export=True), "b": able(nfs_mount=True), "c": able()})

    assert (choice.method, choice.mount_on) == ("sshfs", ("b", "c"))


def test_none_is_chosen_with_the_reason_naming_the_machines_and_what_they_lack():
    head = Abilities(can={"nfs_export": False, "sshfs": True},
                     cannot={"nfs_export": "this kernel has no NFS server (no nfsd in /proc/filesystems)"})

    choice = shared_method("a", {"a": head, "b": able(), "c": able(sshfs=False)})

    assert choice.method == "none" and choice.mount_on == ()
    assert choice.reason == ("a cannot export NFS (this kernel has no NFS server (no nfsd in /proc/filesystems)), "
                             f"and c ({NO_SSHFS}) cannot mount sshfs.")


def test_a_join_keeps_the_cluster_s_method_and_leaves_out_a_newcomer_that_cannot_mount_with_it():
    choice = shared_method("a", {"a": able(nfs_export=True), "b": able(nfs_mount=True), "c": able(nfs_mount=True)},
                           current="sshfs")
    assert choice.method == "sshfs"  # not nfs, though every machine could now: no node is mounted again another way

    newcomer = shared_method("a", {"a": able(), "b": able(), "c": able(sshfs=False)}, current="sshfs")
    assert (newcomer.method, newcomer.mount_on, dict(newcomer.left_out)) == ("sshfs", ("b",), {"c": NO_SSHFS})


def test_the_card_sentence_says_where_shared_is_and_how_each_node_mounts_it():
    nodes = {"gpu-a": "node-0", "gpu-b": "node-1", "gpu-c": "node-2"}
    words = lambda record, n=3: shared_sentence(record, head_node="node-0", node_of=nodes, nodes=n)  # noqa: E731

    assert words({}) == ""
    assert words({"method": "sshfs", "left_out": {}}) == "/shared on node-0, mounted on every node with sshfs."
    assert words({"method": "nfs", "left_out": {"gpu-c": NO_SSHFS + "."}}) == (
        f"/shared on node-0, mounted on the other nodes with nfs, but not on node-2 (gpu-c: {NO_SSHFS}).")
    assert words({"method": "none", "reason": "gpu-a cannot export NFS."}) == (
        "/shared on node-0 only, not shared with the other nodes: gpu-a cannot export NFS.")
    assert words({"method": "sshfs", "left_out": {}}, n=1) == "/shared on node-0, the only node (shared with sshfs when machines join)."


def test_the_console_ships_an_agent_that_shares_files():
    assert not agent_outdated(agent_version(), SHARED_AGENT)


# -- in the cluster's jobs ------------------------------------------------------------------------------------


def test_a_start_exports_on_the_head_then_mounts_on_the_others_with_sshfs(stopped, agents):
    job = run(services.cluster_start(cluster=stopped))

    assert job.state == JobState.SUCCEEDED, job.error
    assert [s["name"] for s in job.steps][-2:] == [steps.WRITE_SETTINGS.name, steps.SHARE_FILES.name]
    assert step_of(job, steps.SHARE_FILES) == {"name": steps.SHARE_FILES.name, "state": StepState.DONE,
                                               "detail": "sshfs: /shared on gpu-a, mounted on 2 other machine(s)"}
    assert calls_to(agents, "shared_export") == [("gpu-a", {"method": "sshfs", "members": ["198.18.1.12", "198.18.1.13"]})]
    assert calls_to(agents, "shared_mount") == [("gpu-b", {"head": "198.18.1.11", "method": "sshfs"}),
                                                ("gpu-c", {"head": "198.18.1.11", "method": "sshfs"})]
    order = [(name, method) for name, method, _ in agents.calls]
    assert order.index(("gpu-a", "shared_export")) < min(order.index((n, "shared_mount")) for n in ("gpu-b", "gpu-c"))
    assert max(order.index((n, "node_files_write")) for n in ("gpu-a", "gpu-b", "gpu-c")) < order.index(("gpu-a", "shared_export"))
    assert shared_of(stopped) == {"method": "sshfs", "reason": "", "left_out": {}}


def test_a_start_uses_nfs_where_the_head_exports_and_the_nodes_mount_nfs(stopped, agents):
    agents.answers["gpu-a"].update(NFS_HEAD)
    for name in ("gpu-b", "gpu-c"):
        agents.answers[name] = {"shared_can": {"nfs_mount": True}}

    assert run(services.cluster_start(cluster=stopped)).state == JobState.SUCCEEDED

    assert {kwargs["method"] for _, kwargs in calls_to(agents, "shared_mount")} == {"nfs"}
    assert shared_of(stopped)["method"] == "nfs"
    # Exported to the two other members' addresses, never to the subnet.
    assert calls_to(agents, "shared_export") == [("gpu-a", {"method": "nfs", "members": ["198.18.1.12", "198.18.1.13"]})]


def test_a_head_whose_agent_exports_nfs_to_the_subnet_gets_sshfs_until_updated(stopped, agents, monkeypatch):
    agents.answers["gpu-a"].update(NFS_HEAD)
    for name in ("gpu-b", "gpu-c"):
        agents.answers[name] = {"shared_can": {"nfs_mount": True}}
    monkeypatch.setattr(shared_runner, "MEMBERS_EXPORT_AGENT", "99.0.0")  # every agent here is older than that

    job = run(services.cluster_start(cluster=stopped))

    assert {kwargs["method"] for _, kwargs in calls_to(agents, "shared_mount")} == {"sshfs"}, job.log


def test_a_node_without_sshfs_makes_the_cluster_share_nothing_and_the_log_says_why(stopped, agents):
    agents.answers["gpu-c"] = {"shared_can": {"sshfs": False}, "shared_cannot": {"sshfs": NO_SSHFS}}

    job = run(services.cluster_start(cluster=stopped))

    assert job.state == JobState.SUCCEEDED, job.error
    assert calls_to(agents, "shared_export") == [("gpu-a", {"method": "none", "members": ["198.18.1.12", "198.18.1.13"]})]
    assert calls_to(agents, "shared_mount") == []
    assert (f"/shared stays on gpu-a only: gpu-a cannot export NFS (exportfs is not installed (apt-get install "
            f"nfs-kernel-server)), and gpu-c ({NO_SSHFS}) cannot mount sshfs.") in job.log


def test_a_node_whose_mount_fails_is_left_out_and_named_and_the_start_still_succeeds(stopped, agents):
    agents.answers["gpu-c"] = {"shared_error": ("not_retryable", "cannot mount /shared from the head 198.18.1.11 with "
                                                                 "sshfs: root@198.18.1.11: Permission denied (publickey).")}

    job = run(services.cluster_start(cluster=stopped))

    assert job.state == JobState.SUCCEEDED, job.error
    assert ("gpu-c could not mount /shared from gpu-a: cannot mount /shared from the head 198.18.1.11 with sshfs: "
            "root@198.18.1.11: Permission denied (publickey).") in job.log
    assert shared_of(stopped)["left_out"] == {"gpu-c": "cannot mount /shared from the head 198.18.1.11 with sshfs: "
                                                       "root@198.18.1.11: Permission denied (publickey)"}
    assert step_of(job, steps.SHARE_FILES)["detail"].endswith("; not on gpu-c")


def test_the_head_refusing_its_export_fails_the_start_in_its_words(stopped, agents):
    agents.answers["gpu-a"]["shared_error"] = ("not_retryable", "exportfs -ra refused the export of /shared: bad option")

    job = run(services.cluster_start(cluster=stopped))

    assert job.state == JobState.FAILED
    assert job.error == "gpu-a: exportfs -ra refused the export of /shared: bad option"
    assert calls_to(agents, "shared_mount") == []


def test_a_start_taken_up_again_in_the_share_step_runs_it_again(stopped, agents, settings):
    settings.FADEN_JOB_STALE = 45
    Cluster.objects.filter(pk=stopped.pk).update(state=ClusterState.STARTING)
    stopped.members.update(state=MemberState.RAY)
    agents.shared["gpu-b"] = {"role": "node", "method": "sshfs", "head": "198.18.1.11"}  # mounted before the worker died
    names = steps.START.step_names
    done = [{"name": name, "state": StepState.DONE, "detail": ""} for name in names[:names.index(steps.SHARE_FILES.name)]]
    job = JobFactory(kind=steps.START.kind, title="Start gpu-room", target_type="cluster", target_id=stopped.pk,
                     params={"restart": False}, state=JobState.RUNNING, resumes=1, worker="dead-worker",
                     steps=[*done, {"name": steps.SHARE_FILES.name, "state": StepState.RUNNING, "detail": ""}],
                     started_at=timezone.now() - timedelta(minutes=11), beat_at=timezone.now() - timedelta(minutes=10))

    job = run(job)

    assert job.state == JobState.SUCCEEDED, job.error
    assert [s["state"] for s in job.steps] == [StepState.DONE] * len(steps.START.steps)
    assert [name for name, _ in calls_to(agents, "shared_mount")] == ["gpu-b", "gpu-c"]
    assert sorted(agents.shared) == ["gpu-a", "gpu-b", "gpu-c"]
    assert Cluster.objects.get(pk=stopped.pk).state == ClusterState.RUNNING


def test_a_machine_joining_keeps_the_cluster_s_method_and_mounts_it(image, agents):
    room = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=image, state=ClusterState.STOPPED)
    assert run(services.cluster_start(cluster=room)).state == JobState.SUCCEEDED
    agents.answers["gpu-a"].update(NFS_HEAD)  # nfs became possible since: the cluster stays with sshfs
    agents.answers["gpu-b"] = {"shared_can": {"nfs_mount": True}}
    agents.answers["gpu-c"] = {"shared_can": {"nfs_mount": True}}
    gpu_c = gpu_machine("gpu-c", 13)

    job = run(services.cluster_add_machines(cluster=Cluster.objects.get(pk=room.pk), machine_ids=[gpu_c.pk]))

    assert job.state == JobState.SUCCEEDED, job.error
    assert step_of(job, steps.SHARE_FILES)["state"] == StepState.DONE
    assert agents.shared["gpu-c"] == {"role": "node", "method": "sshfs", "head": "198.18.1.11"}
    mounts_of_b = [kwargs for name, kwargs in calls_to(agents, "shared_mount") if name == "gpu-b"]
    assert mounts_of_b == [{"head": "198.18.1.11", "method": "sshfs"}] * 2  # asked again: already mounted, nothing changes


def test_a_worker_that_does_not_answer_is_left_out_with_a_log_line(stopped, agents):
    agents.answers["gpu-a"]["ray"]["nodes"] = [node(11), node(12)]
    agents.answers["gpu-c"] = {"error": "Connection refused by 198.18.0.13:22."}

    job = run(services.cluster_start(cluster=stopped))

    assert job.state == JobState.SUCCEEDED, job.error
    assert "gpu-c does not get /shared (not in Ray: it mounts /shared when it joins again)." in job.log
    assert [name for name, _ in calls_to(agents, "shared_mount")] == ["gpu-b"]


def test_a_delete_unmounts_every_node_before_the_head_and_before_the_settings_go(stopped, agents):
    assert run(services.cluster_start(cluster=stopped)).state == JobState.SUCCEEDED
    agents.calls.clear()

    job = run(services.cluster_delete(cluster=Cluster.objects.get(pk=stopped.pk)))

    assert job.state == JobState.SUCCEEDED, job.error
    assert [s["name"] for s in job.steps] == [steps.STOP_ALL.name, steps.OPEN_FIREWALL.name, steps.REMOVE_SECRETS.name,
                                              steps.UNMOUNT_SHARED.name, steps.REMOVE_SETTINGS.name,
                                              steps.DELETE_RECORD.name]
    order = [(name, method) for name, method, _ in agents.calls]
    assert max(order.index((n, "shared_unmount")) for n in ("gpu-b", "gpu-c")) < order.index(("gpu-a", "shared_unmount"))
    assert max(order.index((n, "shared_unmount")) for n in ("gpu-a", "gpu-b", "gpu-c")) < min(
        order.index((n, "node_files_remove")) for n in ("gpu-a", "gpu-b", "gpu-c"))
    assert agents.shared == {}
    assert "The head gpu-a keeps its files in /shared: they stay on that machine until someone removes them." in job.log


def test_a_delete_goes_on_when_a_machine_keeps_its_mount_and_the_log_says_how_to_take_it_away(stopped, agents):
    assert run(services.cluster_start(cluster=stopped)).state == JobState.SUCCEEDED
    Machine.objects.filter(name="gpu-c").update(state=MachineState.OFFLINE)
    agents.answers["gpu-b"] = {"shared_error": ("retryable", "could not unmount /shared (sshfs from root@198.18.1.11:/shared): "
                                                             "device is busy")}

    job = run(services.cluster_delete(cluster=Cluster.objects.get(pk=stopped.pk)))

    assert job.state == JobState.SUCCEEDED, job.error
    assert ("gpu-b kept /shared as gpu-room left it (could not unmount /shared (sshfs from root@198.18.1.11:/shared): device "
            "is busy); to take it away, run python3 /opt/fadenstack/agent/a.pyz shared unmount on it as root.") in job.log
    assert "gpu-c kept /shared as gpu-room left it (it is offline)" in job.log
    assert step_of(job, steps.UNMOUNT_SHARED)["detail"] == "Unmounted on 1 of 3 machine(s)"


def test_the_connect_card_says_which_method_the_cluster_uses(stopped, agents):
    assert run(services.cluster_start(cluster=stopped)).state == JobState.SUCCEEDED
    cluster = Cluster.objects.get(pk=stopped.pk)

    card = pages.connect_card(cluster, roles.ADMINISTRATOR)["connect"]
    assert card.get("waiting") is None, card.get("waiting")
    assert card["shared"] == "/shared on node-0, mounted on every node with sshfs."
    html = pages.render_connect_card({"cluster": cluster, "role": roles.ADMINISTRATOR, "connect": card})
    assert "Shared files: /shared on node-0, mounted on every node with sshfs." in html
