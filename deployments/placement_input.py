"""What placement reads: a cluster's machines as plain data, with what its copies already hold.

One query for the members, one for their GPUs and one for the copies holding room: placement itself
(``deployments/placement.py``) is pure and never touches the database.
"""
from __future__ import annotations

from collections import defaultdict
from fractions import Fraction

from django.db.models import Q

from clusters.choices import MemberState
from clusters.models import Cluster
from deployments import placement
from deployments.choices import HOLDS_ROOM, CopyState
from deployments.models import Copy, Deployment, Drain
from machines.models import Accelerator, short_model

MIB = 2**20
# A machine takes new copies while it is up in the cluster and not draining (a Drain record: draining,
# drained or leaving).
UP = frozenset({MemberState.JOINED})
# A queued copy that has a place holds it too: it starts there once its turn comes.
HOLDS = Q(state__in=HOLDS_ROOM) | Q(state=CopyState.QUEUED, machine__isnull=False)


def gpu_kind(vendor: str, model: str, memory_mib: int | None) -> placement.GpuKind:
    """A GPU's kind: its vendor, its model as people say it (``H100 80GB``), and its memory."""
    return placement.GpuKind(vendor=vendor, model=short_model(model), memory_bytes=(memory_mib or 0) * MIB)


def deployment_kind(deployment: Deployment) -> placement.GpuKind:
    return gpu_kind(deployment.gpu_vendor, deployment.gpu_model, deployment.gpu_memory_mib)


def cluster_rooms(cluster: Cluster, *, leaving_out=(), adding=(), holding=None) -> list[placement.MachineRoom]:
    """The cluster's machines with their GPUs, less what its copies hold (those of ``leaving_out``, copy
    ids, not counted: a copy being placed again gives its own room back), and less ``adding``: more
    ``(slots, deployment id, memory per GPU in MiB)`` held, by copies a plan placed but nobody recorded.
    ``holding``: the copies holding room as those triples, when the caller read them already (the drain plan)."""
    members = list(cluster.members.select_related("machine").order_by("machine__name"))
    machine_ids = [m.machine_id for m in members]
    taken_share: dict[tuple[int, int], Fraction] = defaultdict(Fraction)
    taken_memory: dict[tuple[int, int], int] = defaultdict(int)
    ports: dict[int, set[int]] = defaultdict(set)
    copies_here: dict[int, dict[int, int]] = defaultdict(lambda: defaultdict(int))  # machine -> deployment -> copies
    if holding is None:
        holding = (Copy.objects.filter(HOLDS, deployment__cluster=cluster).exclude(pk__in=list(leaving_out))
                   .values_list("slots", "deployment_id", "deployment__memory_per_gpu_mib"))
    for slots, deployment_id, memory_mib in [*holding, *adding]:
        for slot in slots:
            copies_here[slot["machine"]][deployment_id] += 1
            machine_id = slot["machine"]
            per_gpu = Fraction(slot.get("quarters", 4), 4)  # of each of its GPUs
            for index in slot["gpus"]:
                taken_share[(machine_id, index)] += per_gpu
                taken_memory[(machine_id, index)] += memory_mib * MIB
            if slot.get("port"):
                ports[machine_id].add(slot["port"])
    draining = set(Drain.objects.filter(machine_id__in=machine_ids).values_list("machine_id", flat=True))
    gpus: dict[int, list[placement.Gpu]] = defaultdict(list)
    for machine_id, index, vendor, model, memory_mib, foreign in (
            Accelerator.objects.filter(machine_id__in=machine_ids).order_by("machine_id", "index")
            .values_list("machine_id", "index", "vendor", "model", "memory_mib", "foreign_pids")):
        # A GPU a process the console did not start uses (a person's job) is taken whole: no copy goes there.
        share = max(taken_share[(machine_id, index)], Fraction(1)) if foreign else taken_share[(machine_id, index)]
        gpus[machine_id].append(placement.Gpu(index=index, kind=gpu_kind(vendor, model, memory_mib), share_taken=share,
                                              memory_taken_bytes=taken_memory[(machine_id, index)]))
    return [placement.MachineRoom(id=m.machine_id, name=m.machine.name, arch=m.machine.arch, up=m.state in UP,
                                  accepts_new=m.machine_id not in draining, gpus=tuple(gpus[m.machine_id]), ports_taken=frozenset(ports[m.machine_id]),
                                  deployment_copies=dict(copies_here[m.machine_id]))
            for m in members]


def accelerators_held(cluster: Cluster, machine_ids: list[int]) -> Fraction:
    """The GPUs copies hold on those machines of the cluster (a quarter of a GPU counts as a quarter), and
    those a process the console did not start uses, whole: what placement counts as taken (``cluster_rooms``)."""
    wanted = set(machine_ids)
    share: dict[tuple[int, int], Fraction] = defaultdict(Fraction)
    for slots in Copy.objects.filter(HOLDS, deployment__cluster=cluster).values_list("slots", flat=True):
        for slot in slots:
            if slot["machine"] in wanted:
                for index in slot["gpus"]:
                    share[(slot["machine"], index)] += Fraction(slot.get("quarters", 4), 4)
    for machine_id, index in (Accelerator.objects.filter(machine_id__in=wanted).exclude(foreign_pids=[])
                              .values_list("machine_id", "index")):
        share[(machine_id, index)] = max(share[(machine_id, index)], Fraction(1))
    return sum(share.values(), Fraction(0))


def gpus_held(cluster: Cluster) -> dict[int, set[int]]:
    """The GPU indices copies hold on each machine of the cluster (a share holds its GPU), and those stopped
    copies take again when the cluster starts: what a person's own jobs leave alone (``hooks.gpus_held``)."""
    held: dict[int, set[int]] = defaultdict(set)
    back = Q(state=CopyState.STOPPED, machine__isnull=False)
    for slots in Copy.objects.filter(HOLDS | back, deployment__cluster=cluster).values_list("slots", flat=True):
        for slot in slots:
            held[slot["machine"]].update(slot["gpus"])
    return dict(held)
