"""The cluster's Ray token (clusters/ray_token.py, clusters/runners/secrets.py), against the fake agent
client: made once and sealed, delivered to every member on stdin before Ray starts or joins there, never in
the job's log or details, removed from the machines and forgotten with the cluster; an agent older than
0.10.0 is refused with the machines' names."""
import json

import pytest

from clusters import ray_token, services, steps
from clusters.choices import ClusterState
from clusters.runners.secrets import check_token_agents
from console.choices import JobState
from console.jobs import JobError
from console.models import SealedSecret
from machines.models import Machine
from tests.builders import cluster_of, gpu_machine
from tests.cluster_jobs import image, node, quiet, run  # noqa: F401 (fixtures)
from tests.fakes import FakeAgents

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def machines():
    return [gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12)]


@pytest.fixture
def agents(monkeypatch):
    fakes = FakeAgents({"gpu-a": {"ray": {"alive_nodes": 2, "gpus": 16, "nodes": [node(11), node(12)]}}})
    return fakes.install(monkeypatch)



def order(agents: FakeAgents, name: str) -> list[str]:
    return [called for machine, called, _ in agents.calls if machine == name]


def test_a_start_delivers_the_cluster_s_one_token_to_every_member_before_ray_starts(image, machines, agents):
    cluster = cluster_of(machines, runtime=image, state=ClusterState.STOPPED)
    job = run(services.cluster_start(cluster=cluster))
    assert job.state == JobState.SUCCEEDED, job.error
    names = [s["name"] for s in job.steps]
    assert names.index(steps.LOAD_IMAGE.name) < names.index(steps.DELIVER_SECRETS.name) < names.index(steps.START_HEAD.name)
    token = ray_token.ray_token(cluster)
    sent = {m: kw for m, called, kw in agents.calls if called == "cluster_secrets_write"}
    assert sent == {"gpu-a": {"cluster": cluster.name, "ray_token": token}, "gpu-b": {"cluster": cluster.name, "ray_token": token}}
    a, b = order(agents, "gpu-a"), order(agents, "gpu-b")
    assert a.index("runtime_start") < a.index("cluster_secrets_write") < a.index("ray_start_head")
    assert b.index("cluster_secrets_write") < b.index("ray_join")
    # Sealed, one per cluster, and nowhere in the job's record.
    assert len(token) >= 40 and token not in SealedSecret.objects.get(name=f"cluster.{cluster.pk}.ray_token").sealed
    assert ray_token.ray_token(cluster) == token
    assert token not in json.dumps([job.steps, job.params, job.error, job.log], default=str)


def test_an_agent_older_than_0_10_is_refused_naming_the_machines_to_update(image, agents):
    cluster = cluster_of([gpu_machine("gpu-a", 11), gpu_machine("gpu-b", 12), gpu_machine("gpu-c", 13)],
                         runtime=image, state=ClusterState.STOPPED)
    Machine.objects.filter(name__in=["gpu-b", "gpu-c"]).update(agent_version="0.9.0")
    with pytest.raises(JobError) as caught:
        check_token_agents(list(cluster.members.select_related("machine")))
    assert caught.value.message.startswith("Ray's token needs agent 0.10.0 or newer; gpu-b (0.9.0), gpu-c (0.9.0) run older")
    assert "Update agent" in caught.value.message


def test_a_delete_removes_the_secrets_after_the_stop_and_forgets_the_token(image, machines, agents):
    cluster = cluster_of(machines, runtime=image)
    ray_token.ray_token(cluster)
    job = run(services.cluster_delete(cluster=cluster))
    assert job.state == JobState.SUCCEEDED, job.error
    names = [s["name"] for s in job.steps]
    assert names.index(steps.STOP_ALL.name) < names.index(steps.REMOVE_SECRETS.name)
    removed = sorted((m, kw["cluster"]) for m, called, kw in agents.calls if called == "cluster_secrets_remove")
    assert removed == [("gpu-a", cluster.name), ("gpu-b", cluster.name)]
    assert not SealedSecret.objects.filter(name=f"cluster.{cluster.pk}.ray_token").exists()
