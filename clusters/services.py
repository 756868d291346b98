"""Everything that changes a cluster: create, start, stop, delete, grow and shrink it, switch its
runtime and network, repair it, and measure its networks.

The wizard, the API and the tasks call these; the decisions themselves (what
can be picked, the head, the network, who sends the image to whom) are pure
functions in planning.py.
"""
from __future__ import annotations

import re
from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from clusters import planning, policy
from clusters.choices import (CAN_RETRY, CAN_START, CAN_STOP, CHECKED, CLUSTER_TRANSITIONS, CheckTrigger, ClusterState,
                              MemberState, Role)
from clusters.models import Cluster, ClusterMember, NetworkMeasurement, RuntimeImage
from console import live
from console.choices import JOB_ACTIVE
from console.jobs import job_create
from console.lifecycle import transition
from console.models import Job
from machines.choices import MachineState
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
        _start_job(cluster=cluster, user=user)
        for machine in locked.values():
            live.push("machines", part=str(machine.pk))
    return cluster


START_KIND, STOP_KIND, DELETE_KIND, ADD_KIND, REJOIN_KIND = "cluster.start", "cluster.stop", "cluster.delete", "cluster.add", "cluster.rejoin"
RESTART_STEP = "Stop Ray on every machine"
STOP_STEPS = ["Stop Ray and the runtime"]
DELETE_STEPS = ["Stop Ray and the runtime", "Delete the record"]
ADD_STEPS = ["Check the way to the head", "Get the runtime image", "Load the image", "Join Ray", "Check with Ray"]
REJOIN_STEPS = ["Take it out of Ray", "Start its runtime", "Join Ray", "Check with Ray"]


def cluster_busy(cluster: Cluster) -> Job | None:
    """The operation under way on the cluster, if any: one at a time."""
    return Job.objects.filter(target_type="cluster", target_id=cluster.pk, state__in=JOB_ACTIVE).first()


def _refuse_if_busy(cluster: Cluster, what: str) -> None:
    job = cluster_busy(cluster)
    if job:
        raise ValidationError(f"{cluster.name} is busy: {job.title} is {job.get_state_display().lower()}. {what} once it has finished.")


def _cancel_start(cluster: Cluster, what: str) -> None:
    """Stop and Delete win over a start or a repair under way: it is asked to end at its next step,
    and the stop waits for it. Another stop or delete under way refuses."""
    job = cluster_busy(cluster)
    if job is None:
        return
    if job.kind not in (START_KIND, ADD_KIND, REJOIN_KIND):
        _refuse_if_busy(cluster, what)
    Job.objects.filter(target_type="cluster", target_id=cluster.pk, state__in=JOB_ACTIVE).update(cancel_requested=True)


def _locked(cluster: Cluster) -> Cluster:
    """The cluster's row, locked until the transaction ends, so that two requests cannot both act on it."""
    return Cluster.objects.select_for_update().get(pk=cluster.pk)


def _cluster_job(cluster: Cluster, *, kind: str, title: str, steps: list[str], user=None, params: dict | None = None) -> Job:
    from clusters.tasks import cluster_job

    job = job_create(kind=kind, title=title, target_type="cluster", target_id=cluster.pk, steps=steps, user=user, params=params)
    transaction.on_commit(lambda: cluster_job.delay(job.pk))
    cluster_changed(cluster)
    return job


def _start_job(*, cluster: Cluster, user=None, restart: bool = False, reason: str = "") -> Job:
    """Write the start job and enqueue it after commit; the cluster reads Starting meanwhile.
    A restart stops Ray on every machine first."""
    _refuse_if_busy(cluster, "Start it")
    cluster_transition(cluster=cluster, to=ClusterState.STARTING, reason=reason)
    cluster.next_retry_at = None
    cluster.start_attempts += 1
    cluster.save(update_fields=["next_retry_at", "start_attempts"])
    members = ClusterMember.objects.filter(cluster=cluster)
    if restart:
        members.update(state=MemberState.PENDING, state_reason="", accelerators_in_ray=0)
    else:
        members.exclude(state=MemberState.JOINED).update(state=MemberState.PENDING, state_reason="")
    steps = [RESTART_STEP, *START_STEPS] if restart else START_STEPS
    title = f"Restart {cluster.name}" if restart else f"Start {cluster.name}"
    return _cluster_job(cluster, kind=START_KIND, title=title, steps=steps, user=user, params={"restart": restart})


def cluster_start(*, cluster: Cluster, user=None) -> Job:
    """Start: a stopped cluster comes back on its machines, network and runtime."""
    with transaction.atomic():
        cluster = _locked(cluster)
        if cluster.state not in CAN_START:
            raise ValidationError(f"{cluster.name} is {cluster.get_state_display()}: Start is for a stopped cluster.")
        cluster.restart_attempt = 0
        cluster.start_attempts = 0
        cluster.save(update_fields=["restart_attempt", "start_attempts"])
        return _start_job(cluster=cluster, user=user, restart=True, reason="Starting on its machines.")


def cluster_retry(*, cluster: Cluster, user=None) -> Job:
    """Try again: start over at once (the Try again button), while the cluster waits, retries or failed."""
    with transaction.atomic():
        cluster = _locked(cluster)
        if cluster.state not in CAN_RETRY:
            raise ValidationError(f"{cluster.name} is {cluster.get_state_display()}: there is nothing to try again.")
        cluster.restart_attempt = 0
        cluster.save(update_fields=["restart_attempt"])
        return _start_job(cluster=cluster, user=user, restart=True)


def cluster_restart(*, cluster: Cluster, found: str) -> Job:
    """A repair: the head stopped, so the whole cluster restarts (attempt n of 3)."""
    with transaction.atomic():
        cluster = _locked(cluster)
        cluster.restart_attempt += 1
        cluster.save(update_fields=["restart_attempt"])
        reason = f"{policy.restart_words(cluster.restart_attempt, settings.FADEN_RESTART_ATTEMPTS)}: {found}"
        return _start_job(cluster=cluster, restart=True, reason=reason)


def clusters_retry_due(*, now=None) -> list[int]:
    """Start again the clusters whose pause is over (run by beat): a failed start after its growing
    pause, the next restart of a repair, and a Failed cluster every 15 minutes."""
    now = now or timezone.now()
    due = Cluster.objects.filter(state__in=[ClusterState.RETRYING, ClusterState.FAILED], next_retry_at__lte=now)
    started = []
    for cluster in due:
        try:
            with transaction.atomic():
                cluster = _locked(cluster)
                if cluster.state not in (ClusterState.RETRYING, ClusterState.FAILED) or not cluster.next_retry_at or cluster.next_retry_at > now:
                    continue
                attempts = settings.FADEN_RESTART_ATTEMPTS
                if cluster.state == ClusterState.FAILED:
                    _start_job(cluster=cluster, restart=True, reason=f"Trying again, as every {policy.every(settings.FADEN_FAILED_RETRY)} after {attempts} failed restarts.")
                elif cluster.restart_attempt:
                    cluster.restart_attempt += 1
                    cluster.save(update_fields=["restart_attempt"])
                    _start_job(cluster=cluster, restart=True, reason=policy.restart_words(cluster.restart_attempt, attempts) + ".")
                else:
                    _start_job(cluster=cluster)
                started.append(cluster.pk)
        except ValidationError:
            continue  # busy: the next tick looks again
    return started


def cluster_start_failed(*, cluster: Cluster, message: str, kind: str) -> None:
    """Decide from the error's kind: wait for a person, or retry after a growing pause; a repair's
    restarts count up to Failed."""
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
    elif cluster.restart_attempt:
        outcome = policy.restart_failed(message, attempt=cluster.restart_attempt, attempts=settings.FADEN_RESTART_ATTEMPTS,
                                        first_pause=settings.FADEN_RESTART_PAUSE, failed_retry=settings.FADEN_FAILED_RETRY)
        cluster.next_retry_at = timezone.now() + timedelta(seconds=outcome.pause)
        cluster.save(update_fields=["next_retry_at"])
        cluster_transition(cluster=cluster, to=outcome.state, reason=outcome.reason)
    else:
        pause = planning.retry_pause(cluster.start_attempts)
        cluster.next_retry_at = timezone.now() + timedelta(seconds=pause)
        cluster.save(update_fields=["next_retry_at"])
        cluster_transition(cluster=cluster, to=ClusterState.RETRYING, reason=f"{message} Trying again in {pause} s.")


# -- stop and delete ---------------------------------------------------------------------------

NOT_CONFIRMED = "The machines did not confirm the cluster stopped."


def cluster_stop(*, cluster: Cluster, user=None) -> Job:
    """Stop Ray and the runtime on every machine and free their GPUs; machines, network and deployments stay."""
    with transaction.atomic():
        cluster = _locked(cluster)
        if cluster.state not in CAN_STOP:
            raise ValidationError(f"{cluster.name} is {cluster.get_state_display()}: there is nothing to stop.")
        _cancel_start(cluster, "Stop it")
        cluster.next_retry_at = None
        cluster.restart_attempt = 0
        cluster.save(update_fields=["next_retry_at", "restart_attempt"])
        cluster_transition(cluster=cluster, to=ClusterState.STOPPING, reason="Stopping Ray and the runtime on every machine.")
        return _cluster_job(cluster, kind=STOP_KIND, title=f"Stop {cluster.name}", steps=STOP_STEPS, user=user)


def cluster_stop_unconfirmed(*, cluster: Cluster, failures: list[str]) -> str:
    """Some machines did not answer a stop: the cluster waits for a person to stop or delete it again."""
    message = f"{NOT_CONFIRMED} {' '.join(failures)} Check that they are online, then stop or delete again."
    cluster_transition(cluster=cluster, to=ClusterState.WAITING, reason=message)
    return message


def cluster_delete(*, cluster: Cluster, user=None) -> Job | None:
    """Delete: refused while deployments exist; a running cluster is stopped first (a job), then its
    record goes; a stopped cluster, or one whose machines are all offline, goes at once (None)."""
    with transaction.atomic():
        cluster = _locked(cluster)
        if cluster.state == ClusterState.DELETING:
            raise ValidationError(f"{cluster.name} is already being deleted.")
        _cancel_start(cluster, "Delete it")
        members = list(cluster.members.select_related("machine"))
        online = [m for m in members if m.machine.state != MachineState.OFFLINE]
        try:
            plan = policy.delete_plan(name=cluster.name, stopped=cluster.state == ClusterState.STOPPED,
                                      deployments=cluster.deployments.count(), members=len(members), machines_online=len(online))
        except ValueError as exc:
            raise ValidationError(str(exc)) from None
        if plan == policy.DELETE_NOW:
            cluster_record_delete(cluster=cluster)
            return None
        cluster_transition(cluster=cluster, to=ClusterState.DELETING,
                           reason="Stopping Ray and the runtime on the machines that answer, then deleting the cluster.")
        return _cluster_job(cluster, kind=DELETE_KIND, title=f"Delete {cluster.name}", steps=DELETE_STEPS, user=user)


def cluster_record_delete(*, cluster: Cluster) -> None:
    """The cluster's rows go; its machines stay enrolled and free to join another cluster."""
    machine_ids = list(cluster.members.values_list("machine_id", flat=True))
    pk = cluster.pk
    cluster.delete()
    live.push("clusters", part=str(pk))
    live.push(f"cluster:{pk}")
    for machine_id in machine_ids:
        live.push("machines", part=str(machine_id))


# -- grow and shrink --------------------------------------------------------------------------


def cluster_join_verdicts(cluster: Cluster) -> list[tuple[planning.Candidate, planning.Verdict]]:
    """Every machine outside the cluster, and whether it may join (the reason when not)."""
    everyone = candidates()
    head = cluster.members.filter(role=Role.HEAD).values_list("machine_id", flat=True).first()
    members = set(cluster.members.values_list("machine_id", flat=True))
    verdicts = policy.join_check(everyone, image_builds(), head_id=head, network=cluster.network, members=members,
                                 major=cluster.runtime_version)
    return [(c, verdicts[c.id]) for c in everyone if c.id in verdicts]


def cluster_add_machines(*, cluster: Cluster, machine_ids: list[int], user=None) -> Job:
    """Add machines to a running cluster: each is checked (it must reach the head on the cluster's
    network), gets the image from a machine of the cluster, starts its runtime and joins Ray."""
    machine_ids = list(dict.fromkeys(machine_ids))
    if not machine_ids:
        raise ValidationError({"machines": "Tick at least one machine to add."})
    with transaction.atomic():
        cluster = _locked(cluster)
        if cluster.state != ClusterState.RUNNING:
            raise ValidationError(f"Machines join a running cluster; {cluster.name} is {cluster.get_state_display()}.")
        _refuse_if_busy(cluster, "Add machines")
        verdicts = dict((c.id, (c, v)) for c, v in cluster_join_verdicts(cluster))
        already = set(cluster.members.values_list("machine_id", flat=True)) & set(machine_ids)
        if already:
            names = ", ".join(Machine.objects.filter(pk__in=already).values_list("name", flat=True))
            raise ValidationError({"machines": f"{names} already belongs to {cluster.name}."})
        missing = [i for i in machine_ids if i not in verdicts]
        if missing:
            raise ValidationError({"machines": f"No machine has the id {', '.join(map(str, missing))}."})
        refusals = [verdicts[i][1].refusal for i in machine_ids if not verdicts[i][1].selectable]
        if refusals:
            raise ValidationError({"machines": refusals})
        locked = {m.pk: m for m in Machine.objects.select_for_update().filter(pk__in=machine_ids)}
        if ClusterMember.objects.filter(machine_id__in=machine_ids).exists():
            raise ValidationError({"machines": "One of these machines was just put in another cluster; look again."})
        added = []
        for machine_id in machine_ids:
            candidate, verdict = verdicts[machine_id]
            added.append(ClusterMember.objects.create(
                cluster=cluster, machine=locked[machine_id], role=Role.WORKER,
                address=policy.cluster_address(candidate, cluster.network), runtime_image_id=verdict.runtime.id,
            ).pk)
        for machine_id in machine_ids:
            live.push("machines", part=str(machine_id))
        names = ", ".join(verdicts[i][0].name for i in machine_ids)
        return _cluster_job(cluster, kind=ADD_KIND, title=f"Add {names} to {cluster.name}", steps=ADD_STEPS, user=user,
                            params={"members": added})


def cluster_member_remove(*, cluster: Cluster, machine_id: int, user=None) -> None:
    """Remove from cluster, on a stopped cluster: nothing runs, so the machine only leaves the record.
    The head leaves only a stopped cluster; the machine with the most accelerators leads from then on."""
    with transaction.atomic():
        cluster = _locked(cluster)
        member = cluster.members.select_related("machine").filter(machine_id=machine_id).first()
        if member is None:
            raise ValidationError(f"That machine is not in {cluster.name}.")
        name = member.machine.name
        if cluster.state != ClusterState.STOPPED:
            if member.role == Role.HEAD:
                raise ValidationError(f"{name} leads {cluster.name}: to take out the head, stop the cluster first.")
            raise ValidationError(f"{cluster.name} is {cluster.get_state_display()}: a machine leaves a running cluster by a drain, "
                                  f"which comes with deployments. Stop the cluster to take {name} out of its record now.")
        if cluster.members.count() == 1:
            raise ValidationError(f"{name} is the only machine of {cluster.name}: delete the cluster instead.")
        _refuse_if_busy(cluster, "Remove it")
        was_head = member.role == Role.HEAD
        member.delete()
        if was_head:
            rest = candidates(list(cluster.members.values_list("machine_id", flat=True)))
            cluster.members.filter(machine_id=policy.next_head(rest)).update(role=Role.HEAD)
        live.push("machines", part=str(machine_id))
        cluster_changed(cluster)


# -- runtime and network ----------------------------------------------------------------------


def runtime_offer(cluster: Cluster) -> list[dict]:
    """Per build the cluster runs: which machines run it, and the newest certified build for their kind."""
    builds = list(RuntimeImage.objects.filter(certified=True))
    offer: dict[int, dict] = {}
    for member in cluster.members.select_related("runtime_image", "machine"):
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


def cluster_switch_runtime(*, cluster: Cluster, user=None) -> Job | None:
    """Switch every machine to the newest certified build for its kind: the cluster restarts on it.
    A stopped cluster only records the switch; it runs the new build when it starts."""
    offer = [entry for entry in runtime_offer(cluster) if entry["newer"]]
    if not offer:
        raise ValidationError(f"{cluster.name} already runs the newest certified runtime for its machines.")
    with transaction.atomic():
        cluster = _locked(cluster)
        _refuse_if_busy(cluster, "Switch the runtime")
        if cluster.state in (ClusterState.STOPPING, ClusterState.DELETING):
            raise ValidationError(f"{cluster.name} is {cluster.get_state_display()}.")
        for entry in offer:
            ClusterMember.objects.filter(cluster=cluster, runtime_image=entry["image"]).update(
                runtime_image=entry["newer"], image_bytes_done=0, image_bytes_total=0, image_source="", image_rate=0)
        newest = max((e["newer"] for e in offer), key=lambda b: planning.version_key(b.version))
        cluster.runtime_version = newest.major
        cluster.save(update_fields=["runtime_version"])
        words = ", ".join(f"{e['image']} to {e['newer'].version}" for e in offer)
        if cluster.state == ClusterState.STOPPED:
            cluster_changed(cluster)
            return None
        cluster.restart_attempt = 0
        cluster.save(update_fields=["restart_attempt"])
        return _start_job(cluster=cluster, user=user, restart=True, reason=f"Switching the runtime ({words}): restarting the cluster on the new build.")


def cluster_networks(cluster: Cluster) -> list[planning.SharedNetwork]:
    return planning.shared_networks(candidates(list(cluster.members.values_list("machine_id", flat=True))))


def cluster_change_network(*, cluster: Cluster, network: str, user=None) -> Job | None:
    """Move the cluster to another network its machines share: applied by restarting it
    (a stopped cluster uses it when it starts)."""
    networks = {n.subnet: n for n in cluster_networks(cluster)}
    if network not in networks:
        raise ValidationError({"network": f"{network or 'That'} is not a network all of {cluster.name}'s machines share; "
                                          f"pick one of {', '.join(networks) or 'none'}."})
    with transaction.atomic():
        cluster = _locked(cluster)
        if network == cluster.network:
            raise ValidationError({"network": f"{cluster.name} already runs on {network}."})
        _refuse_if_busy(cluster, "Change the network")
        if cluster.state in (ClusterState.STOPPING, ClusterState.DELETING):
            raise ValidationError(f"{cluster.name} is {cluster.get_state_display()}.")
        old = cluster.network
        cluster.network = network
        cluster.save(update_fields=["network"])
        for member in cluster.members.all():
            member.address = networks[network].address_of(member.machine_id)
            member.save(update_fields=["address"])
        if cluster.state == ClusterState.STOPPED:
            cluster_changed(cluster)
            return None
        cluster.restart_attempt = 0
        cluster.save(update_fields=["restart_attempt"])
        return _start_job(cluster=cluster, user=user, restart=True, reason=f"Moving from {old} to {network}: restarting the cluster on it.")


# -- health checks and repairs ----------------------------------------------------------------


def cluster_check_now(*, cluster: Cluster, user=None) -> None:
    """Check now: look at the cluster at once instead of waiting for the next check."""
    from clusters.tasks import cluster_check

    if cluster.state not in CHECKED:
        raise ValidationError(f"{cluster.name} is {cluster.get_state_display()}: checks look at a running cluster.")
    who = getattr(user, "username", "") or "the API"
    transaction.on_commit(lambda: cluster_check.delay(cluster.pk, CheckTrigger.MANUAL, f"by {who}"))


def cluster_check_soon(*, cluster: Cluster) -> None:
    """A check right after a start, so that the raw status and every machine's panel are filled at once
    (it looks like any check; the start's own job has ended by the time it runs)."""
    from clusters.tasks import cluster_check

    transaction.on_commit(lambda: cluster_check.apply_async((cluster.pk, CheckTrigger.STARTED, ""), countdown=2))


def cluster_rejoin(*, cluster: Cluster, member_ids: list[int], reason: str) -> Job:
    """A repair: members that dropped out of Ray are taken out and joined again; the others keep serving."""
    with transaction.atomic():
        cluster = _locked(cluster)
        _refuse_if_busy(cluster, "Repair it")
        ClusterMember.objects.filter(pk__in=member_ids).update(state=MemberState.REJOINING, state_reason=reason)
        cluster_transition(cluster=cluster, to=cluster.state, reason=reason)
        names = ", ".join(ClusterMember.objects.filter(pk__in=member_ids).values_list("machine__name", flat=True))
        return _cluster_job(cluster, kind=REJOIN_KIND, title=f"Join {names} again", steps=REJOIN_STEPS, params={"members": member_ids})


def cluster_machine_went_offline(*, machine_id: int, name: str) -> None:
    """A machine of a running cluster stopped sending heartbeats: look at its cluster now, so that its
    page says so as soon as the machines page does."""
    from clusters.tasks import cluster_check

    member = ClusterMember.objects.select_related("cluster").filter(machine_id=machine_id).first()
    if member is not None and member.cluster.state in CHECKED:
        cluster_id = member.cluster_id
        transaction.on_commit(lambda: cluster_check.delay(cluster_id, CheckTrigger.OFFLINE, name))


def cluster_machine_reconnected(*, machine_id: int, name: str) -> None:
    """A machine came back: look at its running cluster now; a repaired cluster that failed or waits
    between restarts starts over once its head is back."""
    from clusters.tasks import cluster_check

    member = ClusterMember.objects.select_related("cluster").filter(machine_id=machine_id).first()
    if member is None:
        return
    cluster = member.cluster
    if cluster.state == ClusterState.RUNNING:
        transaction.on_commit(lambda: cluster_check.delay(cluster.pk, CheckTrigger.RECONNECT, name))
        return
    if cluster.state in (ClusterState.FAILED, ClusterState.RETRYING) and cluster.restart_attempt:
        head = cluster.members.select_related("machine").filter(role=Role.HEAD).first()
        if head and head.machine.state == MachineState.HEALTHY:
            try:
                with transaction.atomic():
                    _start_job(cluster=_locked(cluster), restart=True, reason=f"{name} reconnected: starting the cluster again.")
            except ValidationError:
                pass  # busy already


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
