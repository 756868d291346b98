"""The cluster's own firewall in its life (clusters/firewall.py, clusters/runners/firewall.py), against the fake
agent client: a start closes it on every machine before Ray starts, a join lets the newcomer in on every member,
a repair writes it again, a delete opens it, a machine removed has its table taken away and the others stop
letting it in; an older agent is refused, naming the machines."""
import pytest

from clusters import firewall, services, steps
from clusters.choices import ClusterState
from clusters.firewall import FirewallError, firewall_spec, with_console
from clusters.models import Cluster, ClusterMember
from console.choices import JobState, StepState
from machines.choices import MachineState
from machines.models import Machine
from tests.builders import cluster_of, gpu_machine
from tests.cluster_jobs import agents, image, node, quiet, run, step_of  # noqa: F401 (fixtures)
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)  # the job's threads read the database on their own connections

PORTS = {"gcs": 6379, "copies": [8100, 8199], "files": 7470}


@pytest.fixture(autouse=True)
def routes(monkeypatch):
    """This host reaches the cluster's network from 198.18.1.1 (the lab's bridge address)."""
    monkeypatch.setattr(firewall, "source_address", lambda destination: "198.18.1.1")


@pytest.fixture
def machines():
    return [gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12), gpu_machine("gpu-c", 13)]




def members_let_in(agents: FakeAgents, cluster: str = "gpu-room") -> dict:
    return {name: tables[cluster]["members"] for name, tables in agents.firewalls.items() if cluster in tables}


def test_the_spec_lets_the_members_in_to_ray_and_the_console_and_gateway_to_the_copies(image, machines, settings):
    settings.FADEN_FIREWALL_ALLOW = ["10.9.0.0/16", "10.8.0.7/32"]
    room = cluster_of(machines, runtime=image)
    spec = firewall_spec(room, list(room.members.all()), console=["198.18.0.1"])
    assert spec == {"members": ["198.18.1.11", "198.18.1.12", "198.18.1.13"],
                    "console": ["198.18.0.1", "198.18.1.1", "10.9.0.0/16", "10.8.0.7"], "gateway": ["198.18.1.1"],
                    "ports": PORTS}
    assert with_console(spec, "198.18.0.1")["console"] == spec["console"]  # already in: once
    assert with_console(spec, "fe80::1")["console"][-1] == "fe80::1"
    assert with_console(spec, "not an address")["console"] == spec["console"]
    settings.FADEN_FIREWALL_ALLOW = ["everyone"]
    with pytest.raises(FirewallError, match="FADEN_FIREWALL_ALLOW: 'everyone' is neither an IP address"):
        firewall_spec(room, list(room.members.all()))


def test_the_route_s_source_address_is_found_without_sending_anything(monkeypatch):
    monkeypatch.undo()
    assert firewall.source_address("127.0.0.1") == "127.0.0.1"
    assert firewall.source_address("not an address") == ""


def test_a_start_closes_the_firewall_on_every_machine_before_the_image_moves_and_ray_starts(image, machines, agents):
    room = cluster_of(machines, runtime=image, state=ClusterState.STOPPED)

    job = run(services.cluster_start(cluster=room))

    assert job.state == JobState.SUCCEEDED, job.error
    names = [s["name"] for s in job.steps]
    # Before the image moves between the machines' file servers, and so before Ray listens on its ports.
    assert names.index(steps.CLOSE_FIREWALL.name) < names.index(steps.GET_IMAGE.name) < names.index(steps.START_HEAD.name)
    assert step_of(job, steps.CLOSE_FIREWALL)["state"] == StepState.DONE
    assert step_of(job, steps.CLOSE_FIREWALL)["detail"].startswith("Closed on 3 machine(s)")
    assert members_let_in(agents) == {name: ["198.18.1.11", "198.18.1.12", "198.18.1.13"]
                                      for name in ("gpu-a", "gpu-b", "gpu-c")}
    spec = agents.firewalls["gpu-a"]["gpu-room"]
    assert spec["console"] == ["198.18.1.1", "198.51.100.1"] and spec["gateway"] == ["198.18.1.1"]
    assert spec["ports"] == PORTS
    order = [(name, method) for name, method, _ in agents.calls]
    assert max(order.index((n, "firewall_write")) for n in ("gpu-a", "gpu-b", "gpu-c")) < order.index(("gpu-a", "ray_start_head"))


def test_a_machine_joining_is_let_in_by_every_member_before_it_joins_ray(image, agents):
    room = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=image, state=ClusterState.STOPPED)
    assert run(services.cluster_start(cluster=room)).state == JobState.SUCCEEDED
    assert members_let_in(agents)["gpu-a"] == ["198.18.1.11", "198.18.1.12"]
    gpu_c = gpu_machine("gpu-c", 13)

    job = run(services.cluster_add_machines(cluster=Cluster.objects.get(pk=room.pk), machine_ids=[gpu_c.pk]))

    assert job.state == JobState.SUCCEEDED, job.error
    names = [s["name"] for s in job.steps]
    assert names.index(steps.CLOSE_FIREWALL.name) < names.index(steps.REACH_HEAD.name) < names.index(steps.GET_IMAGE.name)
    assert members_let_in(agents) == {name: ["198.18.1.11", "198.18.1.12", "198.18.1.13"]
                                      for name in ("gpu-a", "gpu-b", "gpu-c")}
    order = [(name, method) for name, method, _ in agents.calls]
    assert max(order.index((n, "firewall_write")) for n in ("gpu-a", "gpu-b")) < order.index(("gpu-c", "ray_reach"))
    last_write = max(i for i, (_, method) in enumerate(order) if method == "firewall_write")
    assert last_write < order.index(("gpu-c", "ray_join"))


def test_a_member_that_does_not_take_the_new_table_is_named_and_the_join_goes_on(image, agents):
    room = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=image, state=ClusterState.STOPPED)
    assert run(services.cluster_start(cluster=room)).state == JobState.SUCCEEDED
    agents.answers["gpu-b"] = {"firewall_error": ("retryable", "nft refused: Error: Could not process rule")}
    gpu_c = gpu_machine("gpu-c", 13)

    job = run(services.cluster_add_machines(cluster=Cluster.objects.get(pk=room.pk), machine_ids=[gpu_c.pk]))

    assert job.state == JobState.SUCCEEDED, job.error
    assert ("gpu-b kept its firewall without the new machines (nft refused: Error: Could not process rule): "
            "it gets the new one when it is repaired.") in job.log
    assert members_let_in(agents)["gpu-b"] == ["198.18.1.11", "198.18.1.12"]


def test_a_join_is_refused_while_a_member_runs_an_agent_without_the_firewall(image, agents):
    room = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=image, state=ClusterState.STOPPED)
    assert run(services.cluster_start(cluster=room)).state == JobState.SUCCEEDED
    Machine.objects.filter(name="gpu-b").update(agent_version="0.9.0")
    gpu_c = gpu_machine("gpu-c", 13)

    job = run(services.cluster_add_machines(cluster=Cluster.objects.get(pk=room.pk), machine_ids=[gpu_c.pk]))

    assert job.state == JobState.FAILED
    assert job.error == ("The cluster's firewall needs agent 0.10.0 or newer; gpu-b (0.9.0) runs an older one: "
                         "select Refresh facts on its page (it installs this console's agent), then Try again.")
    assert "gpu-c" not in agents.firewalls


def test_a_repair_writes_the_firewall_on_the_machine_that_joins_again(image, machines, agents):
    room = cluster_of(machines, runtime=image)
    gpu_c = ClusterMember.objects.get(machine__name="gpu-c")

    job = run(services.cluster_rejoin(cluster=room, member_ids=[gpu_c.pk], reason="gpu-c dropped out of Ray."))

    assert job.state == JobState.SUCCEEDED, job.error
    assert members_let_in(agents) == {"gpu-c": ["198.18.1.11", "198.18.1.12", "198.18.1.13"]}
    order = [(name, method) for name, method, _ in agents.calls]
    assert order.index(("gpu-c", "firewall_write")) < order.index(("gpu-c", "ray_join"))


def test_a_delete_opens_the_firewall_after_the_stop_and_names_a_machine_that_kept_it(image, machines, agents):
    room = cluster_of(machines, runtime=image)
    for machine in ("gpu-a", "gpu-b", "gpu-c"):
        agents.firewalls[machine] = {"gpu-room": {}}
    agents.answers["gpu-b"] = {"firewall_error": ("not_retryable", "nft refused: Operation not permitted")}

    job = run(services.cluster_delete(cluster=room))

    assert job.state == JobState.SUCCEEDED, job.error
    names = [s["name"] for s in job.steps]
    assert names.index(steps.STOP_ALL.name) + 1 == names.index(steps.OPEN_FIREWALL.name)
    assert {name for name, tables in agents.firewalls.items() if "gpu-room" in tables} == {"gpu-b"}
    assert ("gpu-b kept the firewall of gpu-room (nft refused: Operation not permitted): it goes when the machine "
            "starts another cluster; to take it away now, run python3 /opt/fadenstack/agent/a.pyz firewall remove "
            "--cluster gpu-room on it as root.") in job.log
    assert step_of(job, steps.OPEN_FIREWALL)["detail"] == "Removed from 2 machine(s); 1 kept it"


def test_a_machine_removed_loses_its_table_and_the_others_stop_letting_it_in(image, machines, agents):
    room = cluster_of(machines, runtime=image, state=ClusterState.STOPPED)
    everyone = {"members": ["198.18.1.11", "198.18.1.12", "198.18.1.13"]}
    for machine in ("gpu-a", "gpu-b", "gpu-c"):
        agents.firewalls[machine] = {"gpu-room": everyone}
    gpu_c = Machine.objects.get(name="gpu-c")

    services.cluster_member_remove(cluster=room, machine_id=gpu_c.pk)  # the task runs on commit (eager)

    assert members_let_in(agents) == {"gpu-a": ["198.18.1.11", "198.18.1.12"], "gpu-b": ["198.18.1.11", "198.18.1.12"]}


def test_a_move_to_another_network_writes_every_member_s_table_again_with_the_new_addresses(image, agents):
    room = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)], runtime=image, state=ClusterState.STOPPED)
    for machine in ("gpu-a", "gpu-b"):
        agents.firewalls[machine] = {"gpu-room": {"members": ["198.18.1.11", "198.18.1.12"]}}

    services.cluster_change_network(cluster=room, network="198.18.0.0/24")

    assert members_let_in(agents) == {name: ["198.18.0.11", "198.18.0.12"] for name in ("gpu-a", "gpu-b")}


def test_a_machine_removed_from_a_cluster_never_started_changes_no_other_machine(image, machines, agents):
    room = cluster_of(machines, runtime=image, state=ClusterState.STOPPED)
    Machine.objects.filter(name="gpu-b").update(state=MachineState.OFFLINE)

    services.cluster_member_remove(cluster=room, machine_id=Machine.objects.get(name="gpu-c").pk)

    assert agents.firewalls == {}
    # The refresh only looks at gpu-a's table; the leave job, which clears everything of the cluster's off
    # gpu-c, asks for gpu-c's removal, once.
    assert sorted((n, m) for n, m, _ in agents.calls if m.startswith("firewall")) == [
        ("gpu-a", "firewall_status"), ("gpu-c", "firewall_remove")]
