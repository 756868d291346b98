"""Reads that the pages, the API, the services and the planner share: machines as the planner sees
them, the builds the server holds, measured networks, a cluster's members in order, the operation
under way. Nothing here writes.
"""
from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Count, Min, Prefetch, Q, QuerySet, Sum

from clusters import planning, policy
from clusters.choices import MemberState, Role
from clusters.models import Cluster, ClusterMember, NetworkMeasurement, RuntimeImage, Transfer, head_first
from console import params
from console.choices import JOB_ACTIVE
from console.models import Job
from machines.choices import MachineState
from machines.models import Accelerator, Machine, NetworkInterface, accelerator_summary_of

# What a page needs of a runtime image: its list of chunk hashes (thousands of them) stays in the database.
IMAGE_FIELDS = ("id", "name", "version", "digest", "size_bytes", "arch", "accelerator_vendor", "certified")


def candidates(machine_ids=None) -> list[planning.Candidate]:
    """Machines as the planner sees them, in three queries whatever their number, and as plain rows:
    the columns the planner reads, each machine's accelerators as one row per vendor and model
    (counted by the database), its interfaces as tuples. A machine's facts, its cluster's status and
    its accelerators' serial numbers stay in the database."""
    if machine_ids is not None:
        machine_ids = list(machine_ids)
        if not machine_ids:
            return []
    machines = Machine.objects.order_by("name").values_list(
        "id", "name", "state", "state_reason", "arch", "address", "membership__cluster__name", "container_runtime")
    accelerators = Accelerator.objects.values_list("machine_id", "vendor", "model").annotate(
        count=Count("id"), first=Min("index")).order_by()
    interfaces = NetworkInterface.objects.order_by("machine_id", "name").values_list(
        "machine_id", "name", "addresses", "speed_mbps", "kind", "default_route", "management")
    if machine_ids is not None:
        machines = machines.filter(pk__in=machine_ids)
        accelerators = accelerators.filter(machine_id__in=machine_ids)
        interfaces = interfaces.filter(machine_id__in=machine_ids)
    # A machine's kind is that of its first accelerator (the lowest index); the count is all of them.
    kinds: dict[int, tuple[int, str, str]] = {}
    counts: dict[int, int] = {}
    for machine_id, vendor, model, count, first in accelerators:
        counts[machine_id] = counts.get(machine_id, 0) + count
        if machine_id not in kinds or first < kinds[machine_id][0]:
            kinds[machine_id] = (first, vendor, model)
    ifaces: dict[int, list[planning.Iface]] = {}
    for machine_id, name, addresses, speed, kind, default_route, management in interfaces:
        ifaces.setdefault(machine_id, []).append(planning.Iface(
            name=name, addresses=tuple(addresses), speed_mbps=speed, kind=kind, default_route=default_route, management=management))
    labels = dict(MachineState.choices)
    return [
        planning.Candidate(
            id=pk, name=name, state=state, state_label=labels.get(state, state), state_reason=reason, arch=arch,
            accelerator_vendor=kinds[pk][1] if pk in kinds else "", accelerator_count=counts.get(pk, 0),
            accelerator_model=kinds[pk][2] if pk in kinds else "", cluster_name=cluster_name, ssh_address=address,
            interfaces=tuple(ifaces.get(pk, ())), container_runtime=container_runtime,
        )
        for pk, name, state, reason, arch, address, cluster_name, container_runtime in machines
    ]


def image_builds() -> list[planning.ImageBuild]:
    return [
        planning.ImageBuild(id=i.pk, arch=i.arch, accelerator_vendor=i.accelerator_vendor, version=i.version, certified=i.certified)
        for i in RuntimeImage.objects.only(*IMAGE_FIELDS)
    ]


def measurements(subnets, head_id: int, others) -> dict[str, float]:
    """The slowest measured link from the head to the others on each subnet (a network is as fast as its slowest link)."""
    rows = NetworkMeasurement.objects.filter(subnet__in=subnets, source_id=head_id, target_id__in=others, mbps__isnull=False)
    slowest: dict[str, list[float]] = {}
    for row in rows:
        slowest.setdefault(row.subnet, []).append(row.mbps)
    return {subnet: min(values) for subnet, values in slowest.items() if len(values) == len(set(others))}


def cluster_busy(cluster: Cluster) -> Job | None:
    """The operation under way on the cluster, if any: one at a time."""
    return Job.objects.filter(target_type="cluster", target_id=cluster.pk, state__in=JOB_ACTIVE).first()


def cluster_members(cluster: Cluster, *, accelerators: bool = False, chunks: bool = False, status: bool = True) -> list[ClusterMember]:
    """The members, head first then by name, with their machine, build and transfers, in a few queries.
    A build's list of chunk hashes (thousands) is loaded only for the jobs that ship it (``chunks``),
    each member's last status only when it is shown (``status``)."""
    members = (
        cluster.members.select_related("machine", "runtime_image")
        .defer("machine__facts", *(() if chunks else ("runtime_image__chunk_hashes",)), *(() if status else ("last_status",)))
        .prefetch_related(Prefetch("transfers", queryset=Transfer.objects.order_by("what")))
    )
    if accelerators:
        members = members.prefetch_related("machine__accelerators")
    return sorted(members.order_by("machine__name"), key=head_first)


def accelerator_summaries(machine_ids) -> dict[int, str]:
    """``8 x H100 80GB`` for each machine, from one grouped query rather than every accelerator's row."""
    rows = (Accelerator.objects.filter(machine_id__in=list(machine_ids)).values_list("machine_id", "model")
            .annotate(count=Count("id"), first=Min("index")).order_by("machine_id", "first"))
    counted: dict[int, list[tuple[str, int]]] = {}
    for machine_id, model, count, _first in rows:
        counted.setdefault(machine_id, []).append((model, count))
    return {machine_id: accelerator_summary_of(pairs) for machine_id, pairs in counted.items()}


def cluster_head(cluster: Cluster) -> ClusterMember | None:
    return cluster.members.select_related("machine").filter(role=Role.HEAD).first()


def cluster_machine_ids(cluster: Cluster) -> list[int]:
    """By name (the list's own ordering would join the cluster as well)."""
    return list(cluster.members.order_by("machine__name").values_list("machine_id", flat=True))


def cluster_networks(cluster: Cluster) -> list[planning.SharedNetwork]:
    """The networks every machine of the cluster shares."""
    return planning.shared_networks(candidates(cluster_machine_ids(cluster)))


def cluster_join_verdicts(cluster: Cluster, machine_ids=None) -> list[tuple[planning.Candidate, policy.JoinVerdict]]:
    """Machines outside the cluster (all of them, or those named), and whether each may join (the reason
    when not) with the address it would join with."""
    rows = cluster.members.order_by().values_list(
        "machine_id", "role", "runtime_image_id", "runtime_image__arch", "runtime_image__accelerator_vendor")
    members, head, running = set(), None, {}
    for machine_id, role, image_id, arch, vendor in rows:
        members.add(machine_id)
        head = machine_id if role == Role.HEAD else head
        if image_id is not None:
            running[(arch, vendor)] = image_id  # the build the cluster runs on each platform: a machine that joins gets it too
    # The head is looked at too: a machine of another architecture than the head's is warned about.
    everyone = candidates(None if machine_ids is None else [*machine_ids, *([head] if head else [])])
    verdicts = policy.join_check(everyone, image_builds(), head_id=head, network=cluster.network, members=members,
                                 major=cluster.runtime_version, running=running)
    return [(c, verdicts[c.id]) for c in everyone if c.id in verdicts]


def runtime_offer(cluster: Cluster, members: list[ClusterMember] | None = None) -> list[dict]:
    """Per build the cluster runs: which machines run it, and the newest certified build for their kind
    (``members``: the cluster's, with machine and build, when the caller has them already)."""
    builds = list(RuntimeImage.objects.filter(certified=True).only(*IMAGE_FIELDS))
    offer: dict[int, dict] = {}
    if members is None:
        members = cluster.members.select_related("runtime_image", "machine").only(
            "machine__name", *(f"runtime_image__{f}" for f in IMAGE_FIELDS)).order_by("machine__name")
    for member in sorted(members, key=lambda m: m.machine.name):  # by name, the head among them
        current = member.runtime_image
        if current is None:
            continue
        entry = offer.setdefault(current.pk, {"image": current, "machines": [], "newer": None})
        entry["machines"].append(member.machine.name)
        same_kind = [b for b in builds if b.arch == current.arch and b.accelerator_vendor == current.accelerator_vendor]
        newest = max(same_kind, key=lambda b: planning.version_key(b.version), default=None)
        if newest and planning.version_key(newest.version) > planning.version_key(current.version):
            entry["newer"] = newest
    return list(offer.values())


def probe_job(job_id: int | None) -> Job | None:
    return Job.objects.filter(pk=job_id, kind="cluster.probe").first() if job_id else None


def clusters_with_totals() -> QuerySet[Cluster]:
    """The list's rows: each cluster with its machine and accelerator counts and its head's name, in two
    queries. Neither the clusters' nor the heads' status is loaded, nor the head machine's facts."""
    heads = ClusterMember.objects.filter(role=Role.HEAD).select_related("machine").only("cluster_id", "role", "machine__name").order_by()
    return Cluster.objects.defer("last_status").annotate(
        machine_count=Count("members"),
        machines_up=Count("members", filter=Q(members__state=MemberState.JOINED)),
        accelerators=Sum("members__accelerators_in_ray"),
    ).prefetch_related(Prefetch("members", queryset=heads))


# -- finding machines among many (the wizard's machine step, Add machines, join candidates) --------

PAGE_SIZE = 50
AVAILABLE = "available"  # healthy, in no cluster and with a container runtime: what can be picked
NO_ACCELERATORS = "none"


@dataclass(frozen=True)
class MachineFilter:
    """What a person typed to find machines: part of a name, a kind (vendor/arch), a state, a page."""

    q: str = ""
    kind: str = ""  # "nvidia/x86_64", or "none" for machines without accelerators
    state: str = ""  # "available", or one of MachineState's values
    page: int = 1

    @classmethod
    def from_params(cls, query) -> "MachineFilter":
        """From a query string. Words that match nothing are ignored (they only narrow a list); a page
        that is not a number is refused (console.params), one past the last shows the last."""
        state = query.get("state", "")
        return cls(q=params.text_param(query, "q", max_length=63), kind=params.text_param(query, "kind", max_length=50),
                   state=state if state in {AVAILABLE, *MachineState.values} else "",
                   page=params.int_param(query, "page", default=1))

    @property
    def narrowed(self) -> bool:
        return bool(self.q or self.kind or self.state)


@dataclass(frozen=True)
class MachinePage:
    ids: list[int]
    total: int
    page: int
    pages: int

    @property
    def first(self) -> int:
        return (self.page - 1) * PAGE_SIZE + 1 if self.total else 0

    @property
    def last(self) -> int:
        return self.first + len(self.ids) - 1 if self.ids else 0


def machine_kinds() -> list[tuple[str, str]]:
    """The kinds of the enrolled machines, as (value, label): ``nvidia/x86_64`` -> ``NVIDIA x86_64``."""
    rows = Accelerator.objects.values_list("vendor", "machine__arch").distinct().order_by("vendor", "machine__arch")
    kinds = [(f"{vendor.lower()}/{arch}", f"{planning.vendor_name(vendor)} {arch}") for vendor, arch in rows if vendor and arch]
    return [*dict.fromkeys(kinds), (NO_ACCELERATORS, "No accelerators")]


def machines_page(found: MachineFilter, *, exclude=()) -> MachinePage:
    """One page of the machines the filter finds, by name, leaving out ``exclude`` (the picked ones,
    shown apart); two queries whatever their number."""
    machines = Machine.objects.exclude(pk__in=list(exclude))
    if found.q:
        machines = machines.filter(name__icontains=found.q)
    if found.state == AVAILABLE:
        machines = machines.filter(state=MachineState.HEALTHY, membership__isnull=True).exclude(container_runtime="")
    elif found.state:
        machines = machines.filter(state=found.state)
    if found.kind == NO_ACCELERATORS:
        machines = machines.filter(accelerators__isnull=True)
    elif "/" in found.kind:
        vendor, arch = found.kind.split("/", 1)
        machines = machines.filter(pk__in=Accelerator.objects.filter(vendor__iexact=vendor, machine__arch=arch).values("machine_id"))
    total = machines.count()
    pages = max(1, -(-total // PAGE_SIZE))
    page = min(found.page, pages)
    ids = list(machines.order_by("name").values_list("pk", flat=True)[(page - 1) * PAGE_SIZE:page * PAGE_SIZE])
    return MachinePage(ids=ids, total=total, page=page, pages=pages)
