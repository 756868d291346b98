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


def _load(minutes_ago: float) -> float:
    """The recorded hour's load, 0 to 1: quiet, a rise, a plateau, easing off."""
    if minutes_ago > 45:
        return 0.04
    if minutes_ago > 35:
        return 0.04 + 0.96 * (45 - minutes_ago) / 10
    if minutes_ago > 15:
        return 0.9 + 0.1 * ((int(minutes_ago) * 7) % 5) / 4
    if minutes_ago > 6:
        return 0.9 - 0.5 * (15 - minutes_ago) / 9
    return 0.45


def engine_samples_recorded(deployment, copies, *, now: float, every: int = 60, silent=(28, 24)) -> int:
    """An hour of ``deployment`` under load as its copies' engines told the health checks (EngineSample rows,
    one a copy every ``every`` seconds up to ``now``): requests running and waiting, KV-cache use, the prefix
    cache's counters and the generated tokens rising with the load. The last copy was not read between
    ``silent`` minutes ago and started again after it (its counters from zero)."""
    import datetime

    from deployments.models import EngineSample

    rows, totals = [], {c.pk: [0.0, 0.0, 0.0] for c in copies}  # generated, prefix queries, prefix hits
    for back in range(3600 + 2 * every, -1, -every):
        minutes_ago, load = back / 60, _load(back / 60)
        for index, copy in enumerate(copies):
            share = load * (1.0 + 0.08 * (index - 0.5))
            total = totals[copy.pk]
            if index == len(copies) - 1 and silent[1] < minutes_ago <= silent[0]:
                total[:] = [0.0, 0.0, 0.0]  # restarted: counts from zero
                continue
            total[0] += every * 1700 * share
            total[1] += every * 5200 * share
            total[2] += every * 5200 * share * (0.35 + 0.45 * load)
            rows.append(EngineSample(
                deployment=deployment, copy_pk=copy.pk, copy_number=copy.number,
                taken_at=datetime.datetime.fromtimestamp(now - back, tz=datetime.timezone.utc),
                running=round(22 * share), waiting=max(0, round(30 * share - 22)), kv_cache=round(0.08 + 0.84 * share, 3),
                generation_tokens=total[0], prefix_queries=total[1], prefix_hits=total[2]))
    EngineSample.objects.bulk_create(rows)
    return len(rows)


def gateway_minutes_recorded(deployment, *, now: float, client, prefix: str) -> None:
    """The same hour at the gateway (its Redis hashes, minute by minute): requests with the load, a few
    errors at its height, latency that grows with it."""
    from deployments.gateway import traffic

    current = traffic.minute_of(now)
    for minute in range(current - 60, current + 1):
        load = _load((now - minute * 60) / 60)
        counts = traffic.Counts()
        requests = round(1500 * load)
        for n in range(requests):
            slow = n % 50 == 49  # the slowest fiftieth
            counts.record(deployment.pk, seconds=(0.6 + 1.6 * load) * (4.0 if slow else 1.0 + 0.3 * (n % 7) / 6),
                          error=load > 0.9 and n % 400 == 0)
        traffic.counts_flush(client, prefix, counts, at=minute * 60 + 30)
