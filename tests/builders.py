"""Builders shared by the unit, API and page tests: enrolled machines, runtime builds and clusters
written straight to the database, as the services would leave them."""
from clusters.choices import ClusterState, MemberState, Role
from clusters.models import Cluster, ClusterMember, RuntimeImage
from machines.models import Machine
from tests.factories import AcceleratorFactory, MachineFactory, NetworkInterfaceFactory

NETWORK = "198.18.1.0/24"  # the cluster's network


def gpu_machine(name: str, host: int, *, accelerators: int = 8, vendor: str = "nvidia", model: str = "NVIDIA H100 80GB HBM3",
                cluster_network: bool = True, **fields) -> Machine:
    """An enrolled machine (NVIDIA H100 x86_64 unless told otherwise) on the management network and
    (unless told otherwise) the cluster network."""
    machine = MachineFactory(name=name, address=f"198.18.0.{host}", agent_path="/opt/fadenstack/agent/a.pyz", **fields)
    for _ in range(accelerators):
        AcceleratorFactory(machine=machine, vendor=vendor, model=model)
    NetworkInterfaceFactory(machine=machine, name="eth0", addresses=[f"198.18.0.{host}/24"], default_route=True, management=True)
    if cluster_network:
        NetworkInterfaceFactory(machine=machine, name="eth1", addresses=[f"198.18.1.{host}/24"])
    return machine


def build(version: str, *, certified: bool = True) -> RuntimeImage:
    return RuntimeImage.objects.create(name="NVIDIA x86_64 Runtime", version=version, digest=f"{version:0>64}",
                                       size_bytes=1024, arch="x86_64", accelerator_vendor="nvidia",
                                       path=f"/images/{version}.img", certified=certified)


def cluster_of(machines, *, state=ClusterState.RUNNING, name="gpu-room", runtime=None, state_reason="As the test left it.",
               **fields) -> Cluster:
    """A cluster written straight to the database: the first machine leads; members are up when it runs."""
    cluster = Cluster.objects.create(name=name, state=state, network=NETWORK, state_reason=state_reason, **fields)
    for index, machine in enumerate(machines):
        host = machine.address.rsplit(".", 1)[1]
        ClusterMember.objects.create(
            cluster=cluster, machine=machine, role=Role.HEAD if index == 0 else Role.WORKER, address=f"198.18.1.{host}",
            runtime_image=runtime, state=MemberState.JOINED if state == ClusterState.RUNNING else MemberState.STOPPED,
            accelerators_in_ray=8 if state == ClusterState.RUNNING else 0,
        )
    return cluster


def ready_model(repo: str = "org/chat", *, weight_bytes: int = 16 * 2**30, context_length: int = 8192, **fields):
    """A model whose files are all in the server's store, with the facts its files gave."""
    from deployments.choices import ModelState
    from deployments.models import StoredModel

    facts = {"architecture": "LlamaForCausalLM", "weight_bytes": weight_bytes, "context_length": context_length,
             "dtype": "bfloat16"}
    return StoredModel.objects.create(repo=repo, commit="c" * 40, state=ModelState.READY, bytes_total=weight_bytes,
                                      bytes_done=weight_bytes, facts=facts, **fields)


def deployment_of(cluster, model=None, *, name: str = "llama", copies: int = 1, gpu_quarters: int = 4, **fields):
    """A deployment written straight to the database (no copies), on H100s of x86_64 machines."""
    from deployments.models import Deployment

    return Deployment.objects.create(
        name=name, cluster=cluster, model=model or ready_model(), copies=copies, gpu_quarters=gpu_quarters,
        gpu_vendor="nvidia", gpu_model="NVIDIA H100 80GB HBM3", gpu_memory_mib=81559, arch="x86_64",
        memory_per_gpu_mib=40 * 1024, context_length=8192, **fields)
