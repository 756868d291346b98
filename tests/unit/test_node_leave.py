"""A machine that leaves a cluster keeps nothing of it (clusters/node_leave.py), against the fake agent client:
its /shared and node settings go (or at its next contact when it is away), the node key changes on the others,
and a delete that could not reach a machine records what it owes too."""
import pytest

from clusters import services, steps, tasks
from clusters.choices import ClusterState, MemberState
from clusters.models import Cluster, ClusterMember, NodeSettingsOwed
from console.choices import JobState
from machines.choices import MachineState
from machines.models import Machine
from tests.builders import cluster_of, gpu_machine
from tests.cluster_jobs import agents, image, node, quiet, run, step_of  # noqa: F401 (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)  # the job's threads read the database on their own connections


@pytest.fixture(autouse=True)
def ca_path(settings, tmp_path):
    settings.FADEN_SSH_CA_KEY_PATH = tmp_path / "ssh" / "ca_ed25519"


@pytest.fixture
def stopped(image):
    return cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12), gpu_machine("gpu-c", 13)], runtime=image,
                      state=ClusterState.STOPPED)




def calls_of(agents, name: str) -> list[str]:
    """What the machine was asked of /shared, its node settings and revocations (its firewall is another job's)."""
    return [called for machine, called, _ in agents.calls if machine == name and called.startswith(("shared_", "node_"))]


def test_a_machine_leaving_a_stopped_cluster_loses_its_settings_and_the_others_get_a_new_node_key(stopped, agents):
    from clusters.node_files import node_key_for

    old_key = node_key_for(cluster=stopped).public_key
    gpu_c = Machine.objects.get(name="gpu-c")

    job = run(services.cluster_member_remove(cluster=stopped, machine_id=gpu_c.pk))

    assert job.state == JobState.SUCCEEDED, job.error
    assert [s["name"] for s in job.steps] == [steps.CLEAR_LEFT.name, steps.ROTATE_KEY.name, steps.SHARE_FILES.name]
    assert calls_of(agents, "gpu-c") == ["shared_unmount", "node_files_remove"]
    # Nothing of the cluster's stays: its firewall table and its secrets directory (Ray's token, TLS keys) go too.
    gone = [(called, kwargs) for machine, called, kwargs in agents.calls if machine == "gpu-c"]
    assert ("cluster_secrets_remove", {"cluster": stopped.name}) in gone
    assert ("firewall_remove", {"cluster": stopped.name}) in gone
    new_key = Cluster.objects.get(pk=stopped.pk).node_public_key
    assert new_key and new_key.split()[1] != old_key.split()[1]
    for name in ("gpu-a", "gpu-b"):
        assert agents.node_files[name]["ssh"]["public_key"] == new_key  # written with the new key, stopped as they are
        assert [n["address"] for n in agents.node_files[name]["ssh"]["nodes"]] == ["198.18.1.11", "198.18.1.12"]
    assert "gpu-c" not in agents.node_files
    assert not NodeSettingsOwed.objects.exists()


def test_a_machine_away_owes_its_settings_and_gives_them_up_at_its_next_contact(stopped, agents):
    gpu_c = Machine.objects.get(name="gpu-c")
    Machine.objects.filter(pk=gpu_c.pk).update(state=MachineState.OFFLINE)

    job = run(services.cluster_member_remove(cluster=stopped, machine_id=gpu_c.pk))

    assert job.state == JobState.SUCCEEDED, job.error
    assert calls_of(agents, "gpu-c") == []
    assert "gpu-c still holds gpu-room's node settings (it is offline): they are taken away at its next contact" in job.log
    owed = NodeSettingsOwed.objects.get(machine=gpu_c)
    assert owed.cluster_name == "gpu-room" and owed.attempts == 1
    assert agents.node_files["gpu-a"]["ssh"]["public_key"] == Cluster.objects.get(pk=stopped.pk).node_public_key

    Machine.objects.filter(pk=gpu_c.pk).update(state=MachineState.HEALTHY)
    tasks.machine_came_back(gpu_c.pk)  # what its first heartbeat after Offline enqueues

    assert calls_of(agents, "gpu-c") == ["shared_unmount", "node_files_remove"]
    assert not NodeSettingsOwed.objects.exists()


def test_a_running_cluster_shares_shared_again_without_the_machine_that_left(image, agents):
    cluster = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12), gpu_machine("gpu-c", 13)], runtime=image)
    agents.answers["gpu-a"] = {"ray": {"alive_nodes": 2, "gpus": 16, "nodes": [node(11), node(12)]},
                               "shared_can": {"nfs_export": True, "nfs_mount": True}}
    agents.answers["gpu-b"] = {"shared_can": {"nfs_mount": True}}
    Cluster.objects.filter(pk=cluster.pk).update(shared_files={"method": "nfs", "reason": "", "left_out": {}})
    gpu_c = Machine.objects.get(name="gpu-c")
    ClusterMember.objects.filter(machine=gpu_c).update(state=MemberState.FAILED)

    job = run(services.cluster_member_remove(cluster=Cluster.objects.get(pk=cluster.pk), machine_id=gpu_c.pk))

    assert job.state == JobState.SUCCEEDED, job.error
    exports = [kwargs for machine, called, kwargs in agents.calls if called == "shared_export"]
    assert exports == [{"method": "nfs", "members": ["198.18.1.12"]}]


def test_a_delete_that_cannot_reach_a_machine_records_what_it_owes(stopped, agents):
    Machine.objects.filter(name="gpu-b").update(state=MachineState.OFFLINE)

    job = run(services.cluster_delete(cluster=stopped))

    assert job.state == JobState.SUCCEEDED, job.error
    assert list(NodeSettingsOwed.objects.values_list("machine__name", "cluster_name")) == [("gpu-b", "gpu-room")]


def test_a_machine_that_joined_another_cluster_owes_nothing_of_the_old_one(stopped, agents, image):
    gpu_c = Machine.objects.get(name="gpu-c")
    Machine.objects.filter(pk=gpu_c.pk).update(state=MachineState.OFFLINE)
    run(services.cluster_member_remove(cluster=stopped, machine_id=gpu_c.pk))
    other = cluster_of([gpu_machine("gpu-d", 14)], runtime=image, name="other-room", state=ClusterState.STOPPED)
    ClusterMember.objects.create(cluster=other, machine=gpu_c, address="198.18.1.13", runtime_image=image)
    Machine.objects.filter(pk=gpu_c.pk).update(state=MachineState.HEALTHY)

    tasks.machine_came_back(gpu_c.pk)

    assert calls_of(agents, "gpu-c") == [] and not NodeSettingsOwed.objects.exists()
