"""A copy over several machines, with fake agents: a Ray of its own on them (its head on the first machine,
a node on each other one, each with only the copy's GPUs of that machine), the engine joining it, the stop
ending the engine first and then every node at once, and an agent too old for it named."""
import pytest

from deployments import copy_procs, services
from deployments.choices import CopyState
from machines.models import Machine
from tests.factories import UserFactory
from tests.fakes import FakeAgents
from tests.unit.test_deployments import ask, cluster, model  # noqa: F401 (fixtures)
from console import roles

pytestmark = pytest.mark.django_db(transaction=True)  # copies start from a pool of threads


@pytest.fixture
def fakes(monkeypatch):
    return FakeAgents().install(monkeypatch)


def spanning(cluster, model):  # noqa: F811
    return ask(cluster, model, copies=1, gpu_quarters=64)  # 16 GPUs: two machines of 8


def test_a_copy_over_two_machines_runs_its_own_ray_there_and_the_engine_joins_it(cluster, model, fakes):  # noqa: F811
    deployment = services.deployment_create(ask=spanning(cluster, model), user=UserFactory(role=roles.OPERATOR))
    copy = deployment.copy_rows.get()
    assert copy.state == CopyState.SERVING, copy.state_reason
    first, second = [cluster.members.get(machine_id=slot["machine"]) for slot in copy.slots]
    starts = [(name, kw) for name, method, kw in fakes.calls if method == "copy_start"]
    assert [(name, kw["copy"]) for name, kw in starts] == [
        (first.machine.name, f"{copy.key}-ray"), (second.machine.name, f"{copy.key}-ray"), (first.machine.name, copy.key)]
    (_, head), (_, node), (_, engine) = starts
    every_gpu = ",".join(str(i) for i in range(8))
    assert head["ray"] == {"head": None, "gpus": 8} and head["address"] == first.address
    assert head["env"] == {"CUDA_VISIBLE_DEVICES": every_gpu}
    gcs = f"{first.address}:{fakes.copies[first.machine.name][copy.key + '-ray']['port']}"
    assert node["ray"] == {"head": gcs, "gpus": 8} and node["address"] == second.address
    assert node["env"] == {"CUDA_VISIBLE_DEVICES": every_gpu}
    assert engine["env"] == {"CUDA_VISIBLE_DEVICES": every_gpu, "RAY_ADDRESS": gcs,
                             "VLLM_API_KEY": engine["env"]["VLLM_API_KEY"]}  # the copy's key: the engine's only
    argv = engine["argv"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "8" and argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    assert argv[argv.index("--distributed-executor-backend") + 1] == "ray"

    fakes.calls.clear()
    services.deployment_delete(deployment=deployment, user=UserFactory(username="ops2", role=roles.OPERATOR))
    stops = [(name, kw["copy"]) for name, method, kw in fakes.calls if method == "copy_stop"]
    assert stops[0] == (first.machine.name, copy.key)  # the engine first: nothing uses its Ray after it
    assert sorted(stops[1:]) == sorted([(first.machine.name, f"{copy.key}-ray"), (second.machine.name, f"{copy.key}-ray")])


def test_a_node_that_does_not_start_fails_the_copy_in_its_words_and_stops_what_started(cluster, model, fakes):  # noqa: F811
    plan = services.deployment_plan(spanning(cluster, model))
    second = Machine.objects.get(pk=plan.placed[0].slots[1].machine_id)
    fakes.answers = {second.name: {"copy_error": ("not_retryable", "ray start: the GCS at 198.18.1.11:40001 did not answer")}}
    deployment = services.deployment_create(ask=spanning(cluster, model), user=UserFactory(role=roles.OPERATOR))
    copy = deployment.copy_rows.get()
    assert copy.state == CopyState.FAILED
    assert copy.state_reason.startswith(f"{second.name}: the copy's Ray node did not start: ")
    assert not any(method == "copy_start" and kw["copy"] == copy.key for _, method, kw in fakes.calls)  # no engine
    stopped = [kw["copy"] for _, method, kw in fakes.calls if method == "copy_stop"]
    assert f"{copy.key}-ray" in stopped  # the head that did start is stopped again


def test_an_agent_too_old_for_a_copy_of_its_own_ray_is_named(cluster, model, fakes):  # noqa: F811
    plan = services.deployment_plan(spanning(cluster, model))
    second = Machine.objects.get(pk=plan.placed[0].slots[1].machine_id)
    Machine.objects.filter(pk=second.pk).update(agent_version="0.5.0")
    deployment = services.deployment_create(ask=spanning(cluster, model), user=UserFactory(role=roles.OPERATOR))
    copy = deployment.copy_rows.get()
    assert copy.state == CopyState.FAILED
    assert copy.state_reason == (f"A copy over several machines needs agent {copy_procs.SPANS_AGENT} or newer on each; "
                                 f"{second.name} (0.5.0): update the agent.")
    assert not [c for c in fakes.calls if c[1] == "copy_start"]
