"""Everything that changes a cluster: create it, start it, retry it, measure its networks.

The wizard, the API and the tasks call these; the decisions themselves (what
can be picked, the head, the network, who sends the image to whom) are pure
functions in planning.py.
"""
from __future__ import annotations

import re
from datetime import timedelta

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from clusters import planning
from clusters.choices import CLUSTER_TRANSITIONS, ClusterState, MemberState, Role
from clusters.models import Cluster, ClusterMember, NetworkMeasurement, RuntimeImage
from console import live
from console.jobs import job_create
from console.lifecycle import transition
from console.models import Job
from machines.models import Machine

START_STEPS = ["Get the runtime image", "Load the image", "Start Ray on the head", "Join the other machines", "Check with Ray"]
_NAME_CHARS = re.compile(r"[a-z0-9-]+")


def cluster_changed(cluster: Cluster, part: str = "") -> None:
    live.push(f"cluster:{cluster.pk}", part=part)
    live.push("clusters", part=str(cluster.pk))


def cluster_transition(*, cluster: Cluster, to: str, reason: str = "") -> bool:
    """The one way a cluster changes state: checked against the table, saved, pushed."""
    return transition(cluster, to=to, allowed=CLUSTER_TRANSITIONS, reason=reason, on_change=lambda: cluster_changed(cluster))


# -- what the wizard shows ----------------------------------------------------------------


def cluster_name_check(name: str) -> None:
    """DNS-label rules, each refusal naming the rule it broke."""
    if not name:
        raise ValidationError({"name": "Enter a cluster name."})
    if len(name) > 63:
        raise ValidationError({"name": f"A cluster name is at most 63 characters; this one has {len(name)}."})
    if not _NAME_CHARS.fullmatch(name):
        raise ValidationError({"name": "A cluster name uses only lowercase letters, digits and hyphens (like gpu-room)."})
    if name[0] == "-" or name[-1] == "-":
        raise ValidationError({"name": "A cluster name starts and ends with a letter or a digit."})
    if Cluster.objects.filter(name=name).exists():
        raise ValidationError({"name": f"There is already a cluster named {name}; pick another name."})


def candidates(machine_ids=None) -> list[planning.Candidate]:
    """Machines as the planner sees them, in two queries whatever their number."""
    machines = Machine.objects.select_related("membership__cluster").prefetch_related("accelerators", "interfaces")
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
                    planning.Iface(
                        name=i.name,
                        addresses=tuple(i.addresses),
                        speed_mbps=i.speed_mbps,
                        kind=i.kind,
                        default_route=i.default_route,
                        management=i.management,
                    )
                    for i in m.interfaces.all()
                ),
            )
        )
    return result


def image_builds() -> list[planning.ImageBuild]:
    return [
        planning.ImageBuild(id=i.pk, arch=i.arch, accelerator_vendor=i.accelerator_vendor, version=i.version, certified=i.certified)
        for i in RuntimeImage.objects.all()
    ]


def measurements(subnets, head_id: int, others) -> dict[str, float]:
    """The slowest measured link from the head to the others on each subnet (a network is as fast as its slowest link)."""
    rows = NetworkMeasurement.objects.filter(subnet__in=subnets, source_id=head_id, target_id__in=others, mbps__isnull=False)
    slowest: dict[str, list[float]] = {}
    for row in rows:
        slowest.setdefault(row.subnet, []).append(row.mbps)
    return {subnet: min(values) for subnet, values in slowest.items() if len(values) == len(set(others))}


def cluster_plan_check(*, machine_ids: list[int], head_id: int | None) -> tuple[list[planning.Candidate], dict]:
    """The picked machines and their verdicts; a ValidationError names every machine that cannot be picked."""
    if not machine_ids:
        raise ValidationError({"machines": "Pick at least one machine."})
    picked = candidates(machine_ids)
    missing = set(machine_ids) - {c.id for c in picked}
    if missing:
        raise ValidationError({"machines": f"No machine has the id {', '.join(map(str, sorted(missing)))}."})
    if head_id is not None and head_id not in machine_ids:
        raise ValidationError({"head": "The head must be one of the picked machines."})
    verdicts = planning.pick_check(picked, image_builds(), head_id=head_id)
    refusals = [verdicts[c.id].refusal for c in picked if not verdicts[c.id].selectable]
    if refusals:
        raise ValidationError({"machines": refusals})
    return picked, verdicts


# -- create, start, retry -----------------------------------------------------------------


def cluster_create(*, name: str, machine_ids: list[int], head_id: int | None, network: str, user=None) -> Cluster:
    """Check everything the wizard checks, write the cluster and its members, and start it."""
    cluster_name_check(name)
    machine_ids = list(dict.fromkeys(machine_ids))
    if head_id is None and len(machine_ids) == 1:
        head_id = machine_ids[0]
    if head_id is None:
        raise ValidationError({"head": "Choose which machine leads the cluster."})
    picked, _ = cluster_plan_check(machine_ids=machine_ids, head_id=head_id)
    networks = {str(n.subnet): n for n in planning.shared_networks(picked)}
    if not networks:
        raise ValidationError({"network": planning.NO_SHARED_NETWORK})
    if network not in networks:
        raise ValidationError(
            {"network": f"{network or 'That'} is not a network all of these machines share; pick one of {', '.join(networks)}."}
        )
    addresses = {member.machine_id: member.address for member in networks[network].members}
    builds = {b.id: b for b in image_builds()}
    with transaction.atomic():
        # Lock the machines so that two wizards cannot put one machine in two clusters.
        locked = {m.pk: m for m in Machine.objects.select_for_update().filter(pk__in=machine_ids)}
        taken = ClusterMember.objects.filter(machine_id__in=machine_ids).select_related("machine", "cluster")
        if taken:
            t = taken[0]
            raise ValidationError({"machines": f"{t.machine.name} is in the cluster {t.cluster.name}: take it out of that cluster before you pick it."})
        cluster = Cluster.objects.create(name=name, network=network)
        for candidate in picked:
            build = planning.runtime_for(candidate, list(builds.values()))
            ClusterMember.objects.create(
                cluster=cluster,
                machine=locked[candidate.id],
                role=Role.HEAD if candidate.id == head_id else Role.WORKER,
                address=addresses[candidate.id],
                runtime_image_id=build.id if build else None,
            )
        cluster_start(cluster=cluster, user=user)
        for machine in locked.values():
            live.push("machines", part=str(machine.pk))
    return cluster


def cluster_start(*, cluster: Cluster, user=None) -> Job:
    """Write the start job and enqueue it after commit; the cluster reads Starting meanwhile."""
    from clusters.tasks import cluster_start as cluster_start_task

    if Job.objects.filter(target_type="cluster", target_id=cluster.pk, state__in=["queued", "running"]).exists():
        raise ValidationError("The cluster is already starting.")
    if cluster.state != ClusterState.STARTING:
        cluster_transition(cluster=cluster, to=ClusterState.STARTING)
    cluster.next_retry_at = None
    cluster.start_attempts += 1
    cluster.save(update_fields=["next_retry_at", "start_attempts"])
    ClusterMember.objects.filter(cluster=cluster).exclude(state=MemberState.JOINED).update(state=MemberState.PENDING, state_reason="")
    job = job_create(
        kind="cluster.start", title=f"Start {cluster.name}", target_type="cluster", target_id=cluster.pk, steps=START_STEPS, user=user
    )
    transaction.on_commit(lambda: cluster_start_task.delay(job.pk))
    cluster_changed(cluster)
    return job


def cluster_retry(*, cluster: Cluster, user=None) -> Job:
    """Try again at once (the Try again button): only while the cluster waits or retries."""
    if cluster.state not in (ClusterState.WAITING, ClusterState.RETRYING, ClusterState.FAILED):
        raise ValidationError(f"{cluster.name} is {cluster.get_state_display()}: there is nothing to try again.")
    with transaction.atomic():
        return cluster_start(cluster=cluster, user=user)


def clusters_retry_due(*, now=None) -> list[int]:
    """Start again the clusters whose growing pause is over (run by beat)."""
    now = now or timezone.now()
    due = Cluster.objects.filter(state=ClusterState.RETRYING, next_retry_at__lte=now)
    started = []
    for cluster in due:
        with transaction.atomic():
            cluster_start(cluster=cluster)
            started.append(cluster.pk)
    return started


def cluster_start_failed(*, cluster: Cluster, message: str, kind: str) -> None:
    """Decide from the error's kind: wait for a person, or retry after a growing pause."""
    message = message.rstrip()
    if message and message[-1] not in ".!?":
        message += "."
    if kind == "not_retryable":
        cluster_transition(
            cluster=cluster, to=ClusterState.WAITING, reason=f"This will not change by retrying: {message} Fix it, then select Try again."
        )
    elif kind == "address_in_use":
        cluster_transition(cluster=cluster, to=ClusterState.WAITING, reason=f"{message} Free the port, then select Try again.")
    elif kind == "no_room":
        cluster_transition(cluster=cluster, to=ClusterState.WAITING, reason=f"{message} Make room, then select Try again.")
    else:
        pause = planning.retry_pause(cluster.start_attempts)
        cluster.next_retry_at = timezone.now() + timedelta(seconds=pause)
        cluster.save(update_fields=["next_retry_at"])
        cluster_transition(cluster=cluster, to=ClusterState.RETRYING, reason=f"{message} Trying again in {pause} s.")


# -- network tests --------------------------------------------------------------------------


def network_probe_start(*, machine_ids: list[int], head_id: int, user=None) -> Job:
    """Measure every shared network between the head and each other machine (the wizard's live test)."""
    from clusters.tasks import network_probe

    picked = candidates(machine_ids)
    if len(picked) < 2:
        raise ValidationError("A network test needs at least two machines.")
    if head_id not in {c.id for c in picked}:
        raise ValidationError({"head": "The head must be one of the picked machines."})
    networks = planning.shared_networks(picked)
    if not networks:
        raise ValidationError(planning.NO_SHARED_NETWORK)
    steps = [str(n.subnet) for n in networks]
    job = job_create(
        kind="cluster.probe", title="Network test", target_type="probe", target_id=head_id, steps=steps, user=user,
        params={"machines": sorted(machine_ids), "head": head_id},
    )
    transaction.on_commit(lambda: network_probe.delay(job.pk))
    return job
