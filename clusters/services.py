"""Everything that changes a cluster: create, start, stop, delete, grow and shrink it, switch its
runtime and network, and repair it. What is checked before a cluster exists (its name, the picked
machines and head, the measured networks) is in choosing.py.

The wizard, the API and the tasks call these. The decisions (what can be picked,
the head, the network, who sends the image to whom) are pure functions in
planning.py and policy.py; which action a cluster allows now (to whom), and the
sentence that refuses the others, are in actions.py; reads are in selectors.py;
the jobs' steps in steps.py. Jobs are sent to their task by kind, after commit.

The services a person calls take ``user``, whose role each checks before anything
else (None: the console itself acts, as a task or beat).
"""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import F
from django.utils import timezone

from clusters import actions, choosing, files_token, hooks, node_files, planning, policy, ray_token, selectors, steps
from clusters.choices import CHECKED, CheckTrigger, ClusterState, MemberState, Role
from clusters.lifecycle import cluster_changed, cluster_locked, cluster_transition, members_transition
from clusters.models import Cluster, ClusterMember, NodeSettingsOwed
from clusters.transfer import transfers_reset
from console import live, roles
from console.choices import JOB_ACTIVE, ErrorKind
from console.jobs import Operation, job_start, task_enqueue
from console.models import Job
from console.offers import Offer
from machines.choices import MachineState
from machines.models import Machine

CHECK_TASK = "clusters.tasks.cluster_check"
FIREWALL_TASK = "clusters.tasks.cluster_firewall_refresh"
JUST_TAKEN = "One of these machines was just put in another cluster; look again."


# -- create, start, retry -------------------------------------------------------------------------


def cluster_create(*, name: str, machine_ids: list[int], head_id: int | None, network: str, user=None) -> Cluster:
    """Check everything the wizard checks, write the cluster and its members, and start it."""
    actions.CREATE.offer(roles.acting(user)).check()
    choosing.cluster_name_check(name)
    machine_ids = list(dict.fromkeys(machine_ids))
    if head_id is None and len(machine_ids) == 1:
        head_id = machine_ids[0]
    if head_id is None:
        raise ValidationError({"head": "Choose which machine leads the cluster."})
    picked, _ = choosing.cluster_plan_check(machine_ids=machine_ids, head_id=head_id)
    networks = {str(n.subnet): n for n in planning.shared_networks(picked)}
    if not networks:
        raise ValidationError({"network": planning.NO_SHARED_NETWORK})
    if network not in networks:
        raise ValidationError(
            {"network": f"{network or 'That'} is not a network all of these machines share; pick one of {', '.join(networks)}."}
        )
    addresses = {member.machine_id: member.address for member in networks[network].members}
    try:
        with transaction.atomic():
            return _cluster_write(name=name, network=network, picked=picked, head_id=head_id, addresses=addresses, user=user)
    except IntegrityError:
        # A request that passed the same checks wrote first: refuse as the checks would now.
        choosing.cluster_name_check(name)
        raise ValidationError({"machines": JUST_TAKEN}) from None


def _cluster_write(*, name: str, network: str, picked: list[planning.Candidate], head_id: int, addresses: dict[int, str],
                   user=None) -> Cluster:
    """The cluster's rows and its start job, in the caller's transaction."""
    machine_ids = [c.id for c in picked]
    # Lock the machines so that two wizards cannot put one machine in two clusters.
    locked = {m.pk: m for m in Machine.objects.select_for_update(no_key=True).filter(pk__in=machine_ids)}
    taken = ClusterMember.objects.filter(machine_id__in=machine_ids).select_related("machine", "cluster")
    if taken:
        t = taken[0]
        raise ValidationError({"machines": f"{t.machine.name} is in the cluster {t.cluster.name}: take it out of that cluster before you pick it."})
    cluster = Cluster.objects.create(name=name, network=network)
    builds = selectors.image_builds()
    for candidate in picked:
        build = planning.runtime_for(candidate, builds)
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


def _actions(cluster: Cluster, user) -> dict[str, Offer]:
    """What the (locked) cluster allows the user now: the role, the state and the operation under way."""
    return actions.cluster_actions(cluster, selectors.cluster_busy(cluster), role=roles.acting(user))


def _cluster_job(cluster: Cluster, operation: Operation, *, title: str, user=None, params: dict | None = None) -> Job:
    job = job_start(kind=operation.kind, title=title, target_type="cluster", target_id=cluster.pk, steps=operation.step_names,
                    user=user, params=params)
    cluster_changed(cluster)
    return job


def _cancel_start(cluster: Cluster) -> None:
    """Stop and Delete win over a start or a repair under way: it is asked to end at its next step,
    and the stop waits for it (actions.py refuses them over another stop or delete)."""
    Job.objects.filter(target_type="cluster", target_id=cluster.pk, state__in=JOB_ACTIVE,
                       kind__in=steps.CANCELLABLE_KINDS).update(cancel_requested=True)


def _start_job(*, cluster: Cluster, user=None, restart: bool = False, reason: str = "") -> Job:
    """Write the start job and enqueue it after commit; the cluster reads Starting meanwhile.
    A restart stops Ray on every machine first."""
    busy = selectors.cluster_busy(cluster)
    if busy:
        raise ValidationError(actions.busy_refusal(cluster, busy, "Start it"))
    cluster_transition(cluster=cluster, to=ClusterState.STARTING, reason=reason)
    cluster.next_retry_at = None
    cluster.start_attempts += 1
    cluster.save(update_fields=["next_retry_at", "start_attempts"])
    members = ClusterMember.objects.filter(cluster=cluster)
    if restart:
        members_transition(members, to=MemberState.PENDING, accelerators_in_ray=0)
    else:
        members_transition(members.exclude(state=MemberState.JOINED), to=MemberState.PENDING)
    operation = steps.RESTART if restart else steps.START
    title = f"Restart {cluster.name}" if restart else f"Start {cluster.name}"
    return _cluster_job(cluster, operation, title=title, user=user, params={"restart": restart})


def _restart(cluster: Cluster, *, reason: str, user=None) -> Job:
    """Start over from the first restart: Try again, a switch of runtime or network."""
    cluster.restart_attempt = 0
    cluster.save(update_fields=["restart_attempt"])
    return _start_job(cluster=cluster, user=user, restart=True, reason=reason)


def cluster_start(*, cluster: Cluster, user=None) -> Job:
    """Start: a stopped cluster comes back on its machines, network and runtime."""
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        _actions(cluster, user)["start"].check()
        cluster.start_attempts = 0
        cluster.save(update_fields=["start_attempts"])
        return _restart(cluster, user=user, reason="Starting on its machines.")


def cluster_retry(*, cluster: Cluster, user=None) -> Job:
    """Try again: start over at once (the Try again button), while the cluster waits, retries or failed."""
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        _actions(cluster, user)["retry"].check()
        return _restart(cluster, user=user, reason="")


def cluster_restart(*, cluster: Cluster, found: str) -> Job:
    """A repair: the head stopped, so the whole cluster restarts (attempt n of 3)."""
    with transaction.atomic():
        cluster = cluster_locked(cluster)
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
                cluster = cluster_locked(cluster)
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
    if kind == ErrorKind.NOT_RETRYABLE:
        cluster_transition(
            cluster=cluster, to=ClusterState.WAITING, reason=f"This will not change by retrying: {message} Fix it, then select Try again."
        )
    elif kind == ErrorKind.ADDRESS_IN_USE:
        cluster_transition(cluster=cluster, to=ClusterState.WAITING, reason=f"{message} Free the port, then select Try again.")
    elif kind == ErrorKind.NO_ROOM:
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


# -- stop and delete ------------------------------------------------------------------------------

NOT_CONFIRMED = "The machines did not confirm the cluster stopped."


def cluster_stop(*, cluster: Cluster, user=None) -> Job:
    """Stop Ray and the runtime on every machine and free their GPUs; machines, network and deployments stay."""
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        _actions(cluster, user)["stop"].check()
        _cancel_start(cluster)
        cluster.next_retry_at = None
        cluster.restart_attempt = 0
        cluster.save(update_fields=["next_retry_at", "restart_attempt"])
        cluster_transition(cluster=cluster, to=ClusterState.STOPPING, reason="Stopping Ray and the runtime on every machine.")
        hooks.cluster_stopping.send(sender=Cluster, cluster=cluster, deleting=False)
        return _cluster_job(cluster, steps.STOP, title=f"Stop {cluster.name}", user=user)


def cluster_stop_unconfirmed(*, cluster: Cluster, failures: list[str]) -> str:
    """Some machines did not answer a stop: the cluster waits for a person to stop or delete it again."""
    message = f"{NOT_CONFIRMED} {' '.join(failures)} Check that they are online, then stop or delete again."
    cluster_transition(cluster=cluster, to=ClusterState.UNCONFIRMED, reason=message)
    return message


def cluster_delete(*, cluster: Cluster, user=None) -> Job | None:
    """Delete: refused while an extension refuses it (deployments on it); a job stops what runs on the
    machines that answer and takes the node settings off them, then the record goes; a cluster whose
    machines are all offline goes at once (None)."""
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        _actions(cluster, user)["delete"].check()  # with what an app above refuses it for (deployments on it)
        _cancel_start(cluster)
        members = list(cluster.members.select_related("machine"))
        online = [m for m in members if m.machine.state != MachineState.OFFLINE]
        if policy.delete_plan(members=len(members), machines_online=len(online)) == policy.DELETE_NOW:
            cluster_record_delete(cluster=cluster)
            return None
        doing = "Taking the node settings off" if cluster.state == ClusterState.STOPPED else "Stopping Ray and the runtime on"
        cluster_transition(cluster=cluster, to=ClusterState.DELETING,
                           reason=f"{doing} the machines that answer, then deleting the cluster.")
        hooks.cluster_stopping.send(sender=Cluster, cluster=cluster, deleting=True)
        return _cluster_job(cluster, steps.DELETE, title=f"Delete {cluster.name}", user=user)


def cluster_record_delete(*, cluster: Cluster) -> None:
    """The cluster's rows go, and its sealed node key and file-server token with them; its machines stay enrolled and free to
    join another cluster. Inside the caller's transaction when there is one (the Delete job's)."""
    machine_ids = selectors.cluster_machine_ids(cluster)
    node_files.node_key_forget(cluster=cluster)
    files_token.files_token_forget(cluster)
    ray_token.ray_token_forget(cluster)
    for machine_id in machine_ids:
        hooks.member_leaving.send(sender=Cluster, cluster=cluster, machine_id=machine_id)
    pk = cluster.pk
    # FOR UPDATE, the one lock stronger than ours: a row being written that refers to this one (a health
    # check, a heartbeat's) takes KEY SHARE, which FOR NO KEY UPDATE lets through, and it would then fail
    # the delete at commit. Now such a writer waits, and finds the cluster gone.
    Cluster.objects.select_for_update().get(pk=pk)
    cluster.delete()
    live.push("clusters", part=str(pk))
    live.push(f"cluster:{pk}")
    for machine_id in machine_ids:
        live.push("machines", part=str(machine_id))


# -- grow and shrink ------------------------------------------------------------------------------


def cluster_add_machines(*, cluster: Cluster, machine_ids: list[int], user=None) -> Job:
    """Add machines to a running cluster: each is checked (it must reach the head on the cluster's
    network), gets the image the cluster runs from a machine of the cluster, starts its runtime and joins Ray."""
    machine_ids = list(dict.fromkeys(machine_ids))
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        _actions(cluster, user)["add"].check()
        if not machine_ids:
            raise ValidationError({"machines": "Tick at least one machine to add."})
        already = set(selectors.cluster_machine_ids(cluster)) & set(machine_ids)
        if already:
            names = ", ".join(Machine.objects.filter(pk__in=already).values_list("name", flat=True))
            raise ValidationError({"machines": f"{names} already belongs to {cluster.name}."})
        verdicts = {c.id: (c, v) for c, v in selectors.cluster_join_verdicts(cluster, machine_ids)}
        choosing.refuse_unknown(machine_ids, verdicts)
        refusals = [verdicts[i][1].refusal for i in machine_ids if not verdicts[i][1].selectable]
        if refusals:
            raise ValidationError({"machines": refusals})
        locked = {m.pk: m for m in Machine.objects.select_for_update(no_key=True).filter(pk__in=machine_ids)}
        if ClusterMember.objects.filter(machine_id__in=machine_ids).exists():
            raise ValidationError({"machines": JUST_TAKEN})
        added = []
        for machine_id in machine_ids:
            _, verdict = verdicts[machine_id]
            added.append(ClusterMember.objects.create(
                cluster=cluster, machine=locked[machine_id], role=Role.WORKER,
                address=verdict.address, runtime_image_id=verdict.runtime.id,
            ).pk)
        for machine_id in machine_ids:
            live.push("machines", part=str(machine_id))
        names = ", ".join(verdicts[i][0].name for i in machine_ids)
        return _cluster_job(cluster, steps.ADD, title=f"Add {names} to {cluster.name}", user=user, params={"members": added})


def cluster_member_remove(*, cluster: Cluster, machine_id: int, user=None, drained: bool = False) -> Job:
    """Remove from cluster: nothing of the cluster serves on the machine (the cluster is stopped, or the
    machine did not join), so it leaves the record at once. The head leaves only a stopped cluster; the
    machine with the most accelerators leads from then on. What the machine holds of the cluster (its node
    settings, /shared) is recorded as owed, and the job LEAVE takes it away and rotates the node key on the
    others (clusters/node_leave.py). ``drained``: the drain of Remove from cluster (deployments) emptied the
    machine of a running cluster and stopped its runtime, so it leaves the record now too."""
    role = roles.acting(user)
    actions.REMOVE.offer(role).check()  # before saying whether the machine is in the cluster
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        member = cluster.members.select_related("machine").filter(machine_id=machine_id).first()
        if member is None:
            raise ValidationError(f"That machine is not in {cluster.name}.")
        actions.member_remove(cluster, member, count=cluster.members.count(), busy=selectors.cluster_busy(cluster), role=role,
                              drained=drained).check()
        hooks.member_leaving.send(sender=Cluster, cluster=cluster, machine_id=machine_id)
        was_head = member.role == Role.HEAD
        member.delete()
        # The others stop letting it in, over SSH: after commit, in a task (the job LEAVE clears the machine).
        task_enqueue(FIREWALL_TASK, cluster.pk)
        if was_head:
            rest = selectors.candidates(selectors.cluster_machine_ids(cluster))
            cluster.members.filter(machine_id=policy.next_head(rest)).update(role=Role.HEAD)
        live.push("machines", part=str(machine_id))
        NodeSettingsOwed.objects.update_or_create(machine=member.machine, defaults={"cluster_name": cluster.name, "shared": True})
        return _cluster_job(cluster, steps.LEAVE, title=f"Take {member.machine.name} out of {cluster.name}", user=user,
                            params={"machine_id": machine_id, "machine_name": member.machine.name})


# -- runtime and network --------------------------------------------------------------------------


def cluster_switch_runtime(*, cluster: Cluster, user=None) -> Job | None:
    """Switch every machine to the newest certified build for its kind: the cluster restarts on it.
    A stopped cluster only records the switch; it runs the new build when it starts."""
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        _actions(cluster, user)["switch"].check()
        offer = [entry for entry in selectors.runtime_offer(cluster) if entry["newer"]]
        if not offer:
            raise ValidationError(f"{cluster.name} already runs the newest certified runtime for its machines.")
        for entry in offer:
            switched = ClusterMember.objects.filter(cluster=cluster, runtime_image=entry["image"])
            transfers_reset(list(switched.values_list("pk", flat=True)))
            switched.update(runtime_image=entry["newer"])
        newest = max((e["newer"] for e in offer), key=lambda b: planning.version_key(b.version))
        cluster.runtime_version = newest.major
        cluster.save(update_fields=["runtime_version"])
        words = ", ".join(f"{e['image']} to {e['newer'].version}" for e in offer)
        if cluster.state == ClusterState.STOPPED:
            cluster_changed(cluster)
            return None
        return _restart(cluster, user=user, reason=f"Switching the runtime ({words}): restarting the cluster on the new build.")


def cluster_change_network(*, cluster: Cluster, network: str, user=None) -> Job | None:
    """Move the cluster to another network its machines share: applied by restarting it
    (a stopped cluster uses it when it starts)."""
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        _actions(cluster, user)["network"].check()
        networks = {n.subnet: n for n in selectors.cluster_networks(cluster)}
        if network not in networks:
            raise ValidationError({"network": f"{network or 'That'} is not a network all of {cluster.name}'s machines share; "
                                              f"pick one of {', '.join(networks) or 'none'}."})
        if network == cluster.network:
            raise ValidationError({"network": f"{cluster.name} already runs on {network}."})
        old = cluster.network
        cluster.network = network
        cluster.save(update_fields=["network"])
        for member in cluster.members.all():
            member.address = networks[network].address_of(member.machine_id)
            member.save(update_fields=["address"])
        # The members' tables let in the new addresses before a start moves the image between them.
        task_enqueue(FIREWALL_TASK, cluster.pk)
        if cluster.state == ClusterState.STOPPED:
            cluster_changed(cluster)
            return None
        return _restart(cluster, user=user, reason=f"Moving from {old} to {network}: restarting the cluster on it.")


# -- health checks and repairs --------------------------------------------------------------------


def cluster_check_now(*, cluster: Cluster, user=None) -> None:
    """Check now: look at the cluster at once instead of waiting for the next check."""
    actions.cluster_actions(cluster, None, role=roles.acting(user))["check"].check()
    who = getattr(user, "username", "") or "the API"
    task_enqueue(CHECK_TASK, cluster.pk, CheckTrigger.MANUAL, f"by {who}")


def cluster_check_soon(*, cluster: Cluster) -> None:
    """A check right after a start, so that the raw status and every machine's panel are filled at once."""
    task_enqueue(CHECK_TASK, cluster.pk, CheckTrigger.STARTED, "", countdown=2)


def cluster_rejoin(*, cluster: Cluster, member_ids: list[int], reason: str) -> Job:
    """A repair: members that dropped out of Ray are taken out and joined again; the others keep serving."""
    with transaction.atomic():
        cluster = cluster_locked(cluster)
        busy = selectors.cluster_busy(cluster)
        if busy:
            raise ValidationError(actions.busy_refusal(cluster, busy, "Repair it"))
        rejoining = ClusterMember.objects.filter(pk__in=member_ids)
        members_transition(rejoining, to=MemberState.REJOINING, reason=reason)
        rejoining.update(rejoin_attempts=F("rejoin_attempts") + 1)
        cluster_transition(cluster=cluster, to=cluster.state, reason=reason)
        names = ", ".join(rejoining.values_list("machine__name", flat=True))
        return _cluster_job(cluster, steps.REJOIN, title=f"Join {names} again", params={"members": member_ids})


def cluster_machine_went_offline(*, machine_id: int, name: str) -> None:
    """A machine of a running cluster stopped sending heartbeats: look at its cluster now, so that its
    page says so as soon as the machines page does."""
    member = ClusterMember.objects.select_related("cluster").filter(machine_id=machine_id).first()
    if member is not None and member.cluster.state in CHECKED:
        task_enqueue(CHECK_TASK, member.cluster_id, CheckTrigger.OFFLINE, name)


def cluster_machine_reconnected(*, machine_id: int, name: str) -> None:
    """A machine came back: look at its running cluster now; a repaired cluster that failed or waits
    between restarts starts over once its head is back."""
    member = ClusterMember.objects.select_related("cluster").filter(machine_id=machine_id).first()
    if member is None:
        return
    cluster = member.cluster
    if cluster.state == ClusterState.RUNNING:
        task_enqueue(CHECK_TASK, cluster.pk, CheckTrigger.RECONNECT, name)
        return
    if cluster.state in (ClusterState.FAILED, ClusterState.RETRYING) and cluster.restart_attempt:
        head = selectors.cluster_head(cluster)
        if head and head.machine.state == MachineState.HEALTHY:
            try:
                with transaction.atomic():
                    _start_job(cluster=cluster_locked(cluster), restart=True, reason=f"{name} reconnected: starting the cluster again.")
            except ValidationError:
                pass  # busy already
