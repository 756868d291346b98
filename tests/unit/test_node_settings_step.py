"""The node settings in a cluster's life (clusters/runners/nodes.py), against the fake agent client: a
start, a join and a repair write every member's once Ray is up, a delete takes them away and forgets
the cluster's node key, a stop keeps them; a machine that refuses is named with its own words, an older
agent is left out with a sentence, and a job taken up again runs the step again."""
from datetime import timedelta

import pytest
from django.utils import timezone

from clusters import services, steps
from clusters.choices import ClusterState, MemberState
from clusters.models import Cluster, ClusterMember
from clusters.node_files import node_key_for, node_key_secret_name
from clusters.runners.nodes import NODE_FILES_AGENT, node_settings_leave
from console import secrets
from console.choices import JobState, StepState
from console.jobs import JobContext, job_create
from machines.agent import agent_version
from machines.choices import MachineState
from machines.models import Machine
from machines.versions import agent_outdated
from tests.builders import cluster_of, gpu_machine
from tests.factories import JobFactory
from tests.cluster_jobs import agents, image, node, quiet, run, step_of  # noqa: F401 (fixtures)
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # the job's threads read the database on their own connections

SSHD_REFUSED = "sshd -t refused the new configuration: line 3: Bad configuration option: TrustedUserCAKey"


@pytest.fixture
def machines():
    return [gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12), gpu_machine("gpu-c", 13)]


@pytest.fixture
def stopped(image, machines):
    return cluster_of(machines, runtime=image, state=ClusterState.STOPPED)


@pytest.fixture
def running(image, machines):
    return cluster_of(machines, runtime=image)




def calls_to(agents: FakeAgents, method: str) -> list[str]:
    return sorted(name for name, called, _ in agents.calls if called == method)


def hostfile_hosts(spec: dict) -> list[str]:
    return [line.split()[0] for line in spec["hostfile"].splitlines() if line and not line.startswith("#")]


# -- written once Ray is up -----------------------------------------------------------------------------


def test_a_start_writes_every_member_s_settings_after_the_check_with_ray_with_every_node_s_host_key(stopped, agents):
    job = run(services.cluster_start(cluster=stopped))

    assert job.state == JobState.SUCCEEDED, job.error
    assert [s["name"] for s in job.steps][-3:] == [steps.CHECK_RAY.name, steps.WRITE_SETTINGS.name, steps.SHARE_FILES.name]
    assert step_of(job, steps.WRITE_SETTINGS) == {"name": steps.WRITE_SETTINGS.name, "state": StepState.DONE,
                                                  "detail": "Written on 3 of 3 machine(s)"}
    assert sorted(agents.node_files) == ["gpu-a", "gpu-b", "gpu-c"]
    order = [(name, method) for name, method, _ in agents.calls]
    assert order.index(("gpu-a", "ray_status")) < min(order.index((name, "node_files_write")) for name in agents.node_files)
    ranks = {name: next(line for line in spec["cluster_env"].splitlines() if line.startswith("NODE_RANK="))
             for name, spec in agents.node_files.items()}
    assert ranks == {"gpu-a": "NODE_RANK=0", "gpu-b": "NODE_RANK=1", "gpu-c": "NODE_RANK=2"}
    known = {n["name"]: n["host_keys"] for n in agents.node_files["gpu-b"]["ssh"]["nodes"]}
    assert known == {"node-0": ["ssh-ed25519 Z3B1LWE="], "node-1": ["ssh-ed25519 Z3B1LWI="], "node-2": ["ssh-ed25519 Z3B1LWM="]}
    assert Cluster.objects.get(pk=stopped.pk).state == ClusterState.RUNNING


def test_a_machine_joining_a_running_cluster_rewrites_every_member_s_hostfile(image, agents):
    room = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=image, state=ClusterState.STOPPED)
    assert run(services.cluster_start(cluster=room)).state == JobState.SUCCEEDED  # the image is on them now
    assert hostfile_hosts(agents.node_files["gpu-a"]) == ["198.18.1.11", "198.18.1.12"]
    gpu_c = gpu_machine("gpu-c", 13)

    job = run(services.cluster_add_machines(cluster=Cluster.objects.get(pk=room.pk), machine_ids=[gpu_c.pk]))

    assert job.state == JobState.SUCCEEDED, job.error
    assert step_of(job, steps.WRITE_SETTINGS)["state"] == StepState.DONE
    assert sorted(agents.node_files) == ["gpu-a", "gpu-b", "gpu-c"]  # the old members too, not only the new one
    assert {name: hostfile_hosts(spec) for name, spec in agents.node_files.items()} == {
        name: ["198.18.1.11", "198.18.1.12", "198.18.1.13"] for name in ("gpu-a", "gpu-b", "gpu-c")}
    assert "198.18.1.13 node-2" in agents.node_files["gpu-a"]["hosts"]


def test_a_repair_writes_every_member_again_once_the_machine_is_back_in_ray(running, agents):
    gpu_c = ClusterMember.objects.get(machine__name="gpu-c")

    job = run(services.cluster_rejoin(cluster=running, member_ids=[gpu_c.pk], reason="gpu-c dropped out of Ray."))

    assert job.state == JobState.SUCCEEDED, job.error
    assert calls_to(agents, "node_files_write") == ["gpu-a", "gpu-b", "gpu-c"]


def test_a_member_not_in_ray_is_left_out_and_the_log_says_it_gets_its_settings_when_it_joins_again(stopped, agents):
    agents.answers["gpu-c"] = {"error": "Connection refused by 198.18.0.13:22."}
    agents.answers["gpu-a"]["ray"]["nodes"] = [node(11), node(12)]

    job = run(services.cluster_start(cluster=stopped))

    assert job.state == JobState.SUCCEEDED, job.error
    assert sorted(agents.node_files) == ["gpu-a", "gpu-b"]
    assert "gpu-c is not in Ray: the node settings are written on it when it joins again." in job.log
    assert step_of(job, steps.WRITE_SETTINGS)["detail"] == "Written on 2 of 3 machine(s); not on gpu-c"
    assert hostfile_hosts(agents.node_files["gpu-a"]) == ["198.18.1.11", "198.18.1.12", "198.18.1.13"]  # still a member


# -- failures -----------------------------------------------------------------------------------------


def test_a_node_that_refuses_its_settings_fails_the_start_with_the_agent_s_words_and_the_machine_s_name(stopped, agents):
    agents.answers["gpu-b"] = {"node_files_error": ("not_retryable", SSHD_REFUSED)}

    job = run(services.cluster_start(cluster=stopped))

    assert (job.state, job.error, job.error_kind) == (JobState.FAILED, f"gpu-b: {SSHD_REFUSED}", "not_retryable")
    assert step_of(job, steps.WRITE_SETTINGS)["state"] == StepState.FAILED
    cluster = Cluster.objects.get(pk=stopped.pk)
    assert cluster.state == ClusterState.WAITING
    assert f"gpu-b: {SSHD_REFUSED}" in cluster.state_reason


def test_a_host_key_other_than_the_pinned_one_never_reaches_the_nodes_known_hosts(stopped, agents):
    agents.answers["gpu-b"] = {"host_key": "ssh-ed25519 c29tZW9uZS1lbHNl"}

    job = run(services.cluster_start(cluster=stopped))

    assert job.state == JobState.FAILED and job.error_kind == "not_retryable"
    assert job.error.startswith("gpu-b's host key SHA256:") and "is not the one the console pinned for it" in job.error
    assert calls_to(agents, "node_files_write") == []


# -- the agent's version --------------------------------------------------------------------------------


def test_the_console_ships_an_agent_that_writes_node_settings():
    assert not agent_outdated(agent_version(), NODE_FILES_AGENT)
    assert agent_outdated("0.6.2", NODE_FILES_AGENT)


def test_a_member_with_an_older_agent_is_left_out_with_a_sentence_to_update_it_and_its_host_key_still_counts(running, agents):
    Machine.objects.filter(name="gpu-b").update(agent_version="0.6.2")
    gpu_c = ClusterMember.objects.get(machine__name="gpu-c")

    job = run(services.cluster_rejoin(cluster=running, member_ids=[gpu_c.pk], reason="gpu-c dropped out of Ray."))

    assert job.state == JobState.SUCCEEDED, job.error
    assert calls_to(agents, "node_files_write") == ["gpu-a", "gpu-c"]
    assert (f"The node settings need agent {NODE_FILES_AGENT} or newer; gpu-b (0.6.2) runs an older one and was left out: "
            "select Update agent on its page, and the settings are written at the cluster's next start or when a machine "
            "joins it.") in job.log
    known = {n["name"]: n["host_keys"] for n in agents.node_files["gpu-a"]["ssh"]["nodes"]}
    assert known["node-1"] == ["ssh-ed25519 Z3B1LWI="]


# -- taken up again -------------------------------------------------------------------------------------


def test_a_start_taken_up_again_in_the_settings_step_runs_it_again_and_skips_what_was_done(stopped, agents, settings):
    settings.FADEN_JOB_STALE = 45
    Cluster.objects.filter(pk=stopped.pk).update(state=ClusterState.STARTING)
    stopped.members.update(state=MemberState.RAY)
    agents.node_files["gpu-a"] = {"cluster": "half-written"}
    done = [{"name": name, "state": StepState.DONE, "detail": ""} for name in steps.START.step_names[:steps.START.step_names.index(steps.WRITE_SETTINGS.name)]]
    job = JobFactory(kind=steps.START.kind, title="Start gpu-room", target_type="cluster", target_id=stopped.pk,
                     params={"restart": False}, state=JobState.RUNNING, resumes=1, worker="dead-worker",
                     steps=[*done, {"name": steps.WRITE_SETTINGS.name, "state": StepState.RUNNING, "detail": ""}],
                     started_at=timezone.now() - timedelta(minutes=11), beat_at=timezone.now() - timedelta(minutes=10))

    job = run(job)

    assert job.state == JobState.SUCCEEDED, job.error
    assert [s["state"] for s in job.steps] == [StepState.DONE] * len(steps.START.steps)
    assert calls_to(agents, "node_files_write") == ["gpu-a", "gpu-b", "gpu-c"]
    assert agents.node_files["gpu-a"]["cluster"] == "gpu-room"
    assert not [call for call in agents.calls if call[1] in ("image_load", "ray_start_head", "ray_join")]
    assert Cluster.objects.get(pk=stopped.pk).state == ClusterState.RUNNING


# -- a stop keeps them, a delete takes them away ------------------------------------------------------------


def test_a_stop_keeps_the_node_settings(running, agents):
    job = run(services.cluster_stop(cluster=running))

    assert job.state == JobState.SUCCEEDED, job.error
    assert calls_to(agents, "runtime_stop") == ["gpu-a", "gpu-b", "gpu-c"]
    assert calls_to(agents, "node_files_remove") == []


def test_a_delete_removes_every_machine_s_settings_after_the_stop_and_forgets_the_node_key(running, agents):
    node_key_for(cluster=running)
    name = node_key_secret_name(running.pk)
    assert secrets.secret_get(name)

    job = run(services.cluster_delete(cluster=running))

    assert job.state == JobState.SUCCEEDED, job.error
    assert [s["name"] for s in job.steps] == [steps.STOP_ALL.name, steps.OPEN_FIREWALL.name, steps.REMOVE_SECRETS.name, steps.UNMOUNT_SHARED.name, steps.REMOVE_SETTINGS.name,
                                              steps.DELETE_RECORD.name]
    assert calls_to(agents, "node_files_remove") == ["gpu-a", "gpu-b", "gpu-c"]
    order = [(machine, method) for machine, method, _ in agents.calls]
    assert all(order.index((m, "runtime_stop")) < order.index((m, "node_files_remove")) for m in ("gpu-a", "gpu-b", "gpu-c"))
    assert step_of(job, steps.REMOVE_SETTINGS)["detail"] == "Removed from 3 of 3 machine(s)"
    assert not Cluster.objects.filter(pk=running.pk).exists()
    assert secrets.secret_get(name) is None


def test_a_delete_goes_on_when_machines_keep_their_settings_and_the_log_names_them(running, agents):
    Machine.objects.filter(name="gpu-c").update(state=MachineState.OFFLINE)
    agents.answers["gpu-b"] = {"node_files_error": ("not_retryable", "Cannot write /etc/hosts: read-only file system.")}

    job = run(services.cluster_delete(cluster=running))

    assert job.state == JobState.SUCCEEDED, job.error
    assert not Cluster.objects.filter(pk=running.pk).exists()
    assert calls_to(agents, "node_files_remove") == ["gpu-a", "gpu-b"]  # an offline machine is not tried
    assert ("gpu-b kept the node settings of gpu-room (Cannot write /etc/hosts: read-only file system): they are replaced "
            "when it joins another cluster; to take them away now, run python3 /opt/fadenstack/agent/a.pyz node files "
            "remove on it as root.") in job.log
    assert "gpu-c kept the node settings of gpu-room (it is offline)" in job.log
    assert "gpu-a kept" not in job.log
    assert step_of(job, steps.REMOVE_SETTINGS)["detail"] == "Removed from 1 of 3 machine(s); left behind on gpu-b, gpu-c"


# -- the hook for machines leaving a running cluster ----------------------------------------------------------


def test_machines_leaving_lose_their_settings_and_the_rest_are_written_without_them(running, agents):
    gpu_c = Machine.objects.get(name="gpu-c")
    agents.node_files["gpu-c"] = {"cluster": "gpu-room"}
    ClusterMember.objects.filter(machine=gpu_c).delete()
    job = job_create(kind="test.leave", title="Take gpu-c out", target_type="cluster", target_id=running.pk,
                     steps=[steps.REMOVE_SETTINGS.name, steps.WRITE_SETTINGS.name])

    node_settings_leave(JobContext(job, on_change=lambda j: None), cluster=running, leaving=[gpu_c])

    assert "gpu-c" not in agents.node_files
    assert calls_to(agents, "node_files_write") == ["gpu-a", "gpu-b"]
    assert hostfile_hosts(agents.node_files["gpu-b"]) == ["198.18.1.11", "198.18.1.12"]
    assert "node-2" not in agents.node_files["gpu-a"]["hosts"]
