"""Reads that the pages, the API, the services and the planner share: machines as the planner sees
them, the builds the server holds, measured networks, a cluster's members in order, the operation
under way. Nothing here writes.
"""
from __future__ import annotations

from django.db.models import Count, Prefetch, Q, QuerySet, Sum

from clusters import planning, policy
from clusters.choices import MemberState, Role
from clusters.models import Cluster, ClusterMember, NetworkMeasurement, RuntimeImage, Transfer, head_first
from console.choices import JOB_ACTIVE
from console.models import Job
from machines.models import Machine

# What a page needs of a runtime image: its list of chunk hashes (thousands of them) stays in the database.
IMAGE_FIELDS = ("id", "name", "version", "digest", "size_bytes", "arch", "accelerator_vendor", "certified")


def candidates(machine_ids=None) -> list[planning.Candidate]:
    """Machines as the planner sees them, in three queries whatever their number. Only the columns the
    planner reads are loaded: a machine's facts and its cluster's status are large JSON it never reads."""
    machines = (
        Machine.objects.only("id", "name", "state", "state_reason", "arch", "address", "membership__cluster__name")
        .select_related("membership__cluster")
        .prefetch_related("accelerators", "interfaces")
    )
    if machine_ids is not None:
        machines = machines.filter(pk__in=machine_ids)
    result = []
    for m in machines.order_by("name"):
        accelerators = list(m.accelerators.all())
        membership = getattr(m, "membership", None)
        result.append(
            planning.Candidate(
                id=m.pk,
                name=m.name,
                state=m.state,
                state_label=m.get_state_display(),
                state_reason=m.state_reason,
                arch=m.arch,
                accelerator_vendor=accelerators[0].vendor if accelerators else "",
                accelerator_count=len(accelerators),
                accelerator_model=accelerators[0].model if accelerators else "",
                cluster_name=membership.cluster.name if membership else None,
                ssh_address=m.address,
                interfaces=tuple(
                    planning.Iface(name=i.name, addresses=tuple(i.addresses), speed_mbps=i.speed_mbps, kind=i.kind,
                                   default_route=i.default_route, management=i.management)
                    for i in m.interfaces.all()
                ),
            )
        )
    return result


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


def cluster_members(cluster: Cluster, *, accelerators: bool = False, chunks: bool = False) -> list[ClusterMember]:
    """The members, head first then by name, with their machine, build and transfers, in a few queries.
    A build's list of chunk hashes (thousands) is loaded only for the jobs that ship it (``chunks``)."""
    members = (
        cluster.members.select_related("machine", "runtime_image")
        .defer("machine__facts", *(() if chunks else ("runtime_image__chunk_hashes",)))
        .prefetch_related(Prefetch("transfers", queryset=Transfer.objects.order_by("what")))
    )
    if accelerators:
        members = members.prefetch_related("machine__accelerators")
    return sorted(members.order_by("machine__name"), key=head_first)


def cluster_head(cluster: Cluster) -> ClusterMember | None:
    return cluster.members.select_related("machine").filter(role=Role.HEAD).first()


def cluster_machine_ids(cluster: Cluster) -> list[int]:
    return list(cluster.members.values_list("machine_id", flat=True))


def cluster_networks(cluster: Cluster) -> list[planning.SharedNetwork]:
    """The networks every machine of the cluster shares."""
    return planning.shared_networks(candidates(cluster_machine_ids(cluster)))


def cluster_build_by_platform(cluster: Cluster) -> dict[tuple[str, str], int]:
    """The build the cluster runs on each platform (arch, vendor): a machine that joins gets the same one."""
    rows = cluster.members.exclude(runtime_image=None).values_list(
        "runtime_image_id", "runtime_image__arch", "runtime_image__accelerator_vendor")
    return {(arch, vendor): image_id for image_id, arch, vendor in rows}


def cluster_join_verdicts(cluster: Cluster, machine_ids=None) -> list[tuple[planning.Candidate, planning.Verdict]]:
    """Machines outside the cluster (all of them, or those named), and whether each may join (the reason when not)."""
    everyone = candidates(machine_ids)
    head = cluster.members.filter(role=Role.HEAD).values_list("machine_id", flat=True).first()
    members = set(cluster_machine_ids(cluster))
    verdicts = policy.join_check(everyone, image_builds(), head_id=head, network=cluster.network, members=members,
                                 major=cluster.runtime_version, running=cluster_build_by_platform(cluster))
    return [(c, verdicts[c.id]) for c in everyone if c.id in verdicts]


def runtime_offer(cluster: Cluster) -> list[dict]:
    """Per build the cluster runs: which machines run it, and the newest certified build for their kind."""
    builds = list(RuntimeImage.objects.filter(certified=True).only(*IMAGE_FIELDS))
    offer: dict[int, dict] = {}
    members = cluster.members.select_related("runtime_image", "machine").only(
        "machine__name", *(f"runtime_image__{f}" for f in IMAGE_FIELDS))
    for member in members:
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
    """The list's rows: each cluster with its machine and accelerator counts and its head, in two queries."""
    return Cluster.objects.defer("last_status").annotate(
        machine_count=Count("members"),
        machines_up=Count("members", filter=Q(members__state=MemberState.JOINED)),
        accelerators=Sum("members__accelerators_in_ray"),
    ).prefetch_related(Prefetch("members", queryset=ClusterMember.objects.filter(role=Role.HEAD).select_related("machine")))
