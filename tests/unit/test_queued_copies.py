"""Queued copies start by themselves when room appears on their cluster, with no action on their own
deployment: another deployment deleted or scaled down, a machine that joins or comes back. Fake agents;
the apply jobs run eagerly, each once its transaction commits."""
import pytest

from clusters.choices import ClusterState, MemberState
from clusters.lifecycle import member_transition
from console import roles
from console.models import Job
from deployments import serving, services
from deployments.store import disk
from deployments.choices import CopyState
from deployments.models import Deployment, ModelFile
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
def cluster():
    return cluster_of([gpu_machine("lab-a", 11), gpu_machine("lab-b", 12)])


@pytest.fixture
def fakes(monkeypatch):
    return FakeAgents().install(monkeypatch)


def model_of(repo: str):
    model = ready_model(repo, weight_bytes=16 * 2**30)
    model.facts["gpu_memory_bytes"] = int(16 * 2**30 * 1.2)
    model.save(update_fields=["facts"])
    ModelFile.objects.create(model=model, path="model.safetensors", size=40 * MiB, sha256=repo[-1] * 64,
                             chunk_size=disk.CHUNK_SIZE, chunk_hashes=["b" * 64] * 5)
    return model


def deploy(cluster, operator, name: str, copies: int, *, queue_rest: bool = False) -> Deployment:
    """A deployment of whole machines (8 H100s a copy) of a model of its own."""
    ask = services.DeployAsk(cluster=cluster, model=model_of(f"org/{name}"), name=name, copies=copies, gpu_quarters=32,
                             vendor="nvidia", gpu_model="NVIDIA H100 80GB HBM3", gpu_memory_mib=H100_MIB, arch="x86_64",
                             memory_per_gpu_mib=70000, context_length=4096)
    return services.deployment_create(ask=ask, queue_rest=queue_rest, user=operator)


def states(deployment: Deployment) -> list[str]:
    return list(deployment.copy_rows.order_by("number").values_list("state", flat=True))


def applies_of(deployment: Deployment) -> int:
    return Job.objects.filter(kind=serving.KIND, target_id=deployment.pk).count()


@pytest.fixture
def full(cluster, fakes, operator):
    """"chat" holds both machines; "code" waits Queued for room."""
    chat = deploy(cluster, operator, "chat", 2)
    code = deploy(cluster, operator, "code", 1, queue_rest=True)
    assert states(chat) == [CopyState.SERVING] * 2 and states(code) == [CopyState.QUEUED]
    assert code.copy_rows.get().state_reason.startswith("Waiting for room: ")
    return chat, code


def test_a_queued_copy_starts_when_another_deployment_is_deleted(full, operator):
    chat, code = full
    applied = applies_of(code)

    services.deployment_delete(deployment=chat, user=operator)

    assert not Deployment.objects.filter(pk=chat.pk).exists()
    assert states(code) == [CopyState.SERVING]
    assert applies_of(code) == applied + 1  # its own apply job, woken by the room; nothing asked of it


def test_a_queued_copy_starts_when_another_deployment_is_scaled_down(full, operator):
    chat, code = full

    services.deployment_scale(deployment=chat, copies=1, user=operator)

    assert states(chat) == [CopyState.SERVING]
    assert states(code) == [CopyState.SERVING]
    assert code.copy_rows.get().machine_id != chat.copy_rows.get().machine_id


def test_a_queued_copy_starts_when_a_machine_comes_back(cluster, fakes, operator):
    gone = cluster.members.get(machine__name="lab-b")
    member_transition(gone, to=MemberState.DOWN, reason="Ray's node list does not hold lab-b as alive.")
    code = deploy(cluster, operator, "code", 2, queue_rest=True)
    assert states(code) == [CopyState.SERVING, CopyState.QUEUED]

    member_transition(gone, to=MemberState.JOINED)

    assert states(code) == [CopyState.SERVING, CopyState.SERVING]
    assert set(code.copy_rows.values_list("machine__name", flat=True)) == {"lab-a", "lab-b"}


def test_a_machine_joining_a_cluster_that_is_not_running_starts_nothing(cluster, fakes, operator):
    gone = cluster.members.get(machine__name="lab-b")
    member_transition(gone, to=MemberState.DOWN, reason="Ray's node list does not hold lab-b as alive.")
    code = deploy(cluster, operator, "code", 2, queue_rest=True)
    type(cluster).objects.filter(pk=cluster.pk).update(state=ClusterState.STARTING)
    applied = applies_of(code)

    member_transition(gone, to=MemberState.JOINED)  # a start's join: the cluster's Running applies everything

    assert states(code) == [CopyState.SERVING, CopyState.QUEUED]
    assert applies_of(code) == applied


def test_only_deployments_with_queued_copies_are_woken(full, cluster, fakes, operator):
    chat, code = full
    services.deployment_scale(deployment=code, copies=0, user=operator)
    applied = applies_of(chat)

    member_transition(cluster.members.get(machine__name="lab-b"), to=MemberState.DOWN, reason="gone")
    member_transition(cluster.members.get(machine__name="lab-b"), to=MemberState.JOINED)

    assert applies_of(chat) == applied


def test_a_queued_copy_starts_when_a_persons_job_leaves_the_gpu_it_waited_for(cluster, fakes, operator):
    from machines.models import Accelerator
    from machines.services import accelerators_foreign_apply

    b = cluster.members.get(machine__name="lab-b").machine
    Accelerator.objects.filter(machine=b, index=0).update(foreign_pids=[4121])  # a person's job on one of lab-b's GPUs
    code = deploy(cluster, operator, "code", 2, queue_rest=True)
    assert states(code) == [CopyState.SERVING, CopyState.QUEUED]

    accelerators_foreign_apply(machine=b, use={})  # lab-b's heartbeat: nothing of anyone else's on its GPUs now

    assert states(code) == [CopyState.SERVING, CopyState.SERVING]
    assert set(code.copy_rows.values_list("machine__name", flat=True)) == {"lab-a", "lab-b"}
