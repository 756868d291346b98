"""Starting a cluster: the runtime image from the server to one machine and on machine to machine,
each machine loads it and starts its runtime, Ray starts on the head, the others join, and the
cluster reads Running once Ray's own node list holds them and the job has ended.

Also the two operations built from the same steps: machines joining a running cluster, and a
repair that joins dropped machines again.
"""
from __future__ import annotations

import time

from django.db import transaction

from clusters import hooks, images, services, steps
from clusters.choices import ClusterState, MemberState, Role
from clusters.fanout import ProgressBoard, offline_reason, on_member, parallel
from clusters.lifecycle import cluster_changed, cluster_transition, member_transition, members_transition
from clusters.models import Cluster, ClusterMember
from clusters.runners.certificates import certificates_issue
from clusters.runners.firewall import firewall_close
from clusters.runners.nodes import node_settings_write
from clusters.runners.secrets import check_token_agents, secrets_deliver
from clusters.runners.shared import shared_files_share
from clusters.selectors import cluster_members
from clusters.transfer import distribute
from console.choices import ErrorKind
from console.jobs import JobCancelled, JobContext, JobError, Step
from machines.agent import agent_version
from machines.agent_results import RayStatus
from machines.choices import MachineState


# The cluster's Ray offers no GPUs: the console's placement is the only allocator of them (each copy is
# started with exactly the GPUs its plan gave it), so Ray can never hand a copy's GPUs to a task of its own.
# A copy that spans machines runs a Ray of its own with only its GPUs (deployments/copy_procs.py).
RAY_GPUS = 0
RAY_LIST_TRIES, RAY_LIST_PAUSE = 5, 2.0  # how long the head's node list is given to show machines that joined


def _stage(ctx: JobContext, step: Step, members, head, board, work, *, tolerate_all: bool = False, detail: str = ""):
    """One step run on every member at once; a step an earlier run of the job finished is skipped."""
    if not step.begin(ctx, detail):
        return members
    return parallel(members, head, board, work, tolerate_all=tolerate_all)


def cluster_start_run(ctx: JobContext, *, cluster_id: int) -> None:
    cluster = Cluster.objects.get(pk=cluster_id)
    try:
        _start(ctx, cluster, restart=bool(ctx.job.params.get("restart")))
    except JobCancelled:
        raise  # a stop or a delete took over: the cluster reads what they say
    except Exception as exc:
        # Whatever broke, the cluster must not stay Starting without a job behind it.
        message, kind = (exc.message, exc.kind) if isinstance(exc, JobError) else (f"Unexpected error: {exc}", ErrorKind.RETRYABLE)
        with transaction.atomic():
            cluster.refresh_from_db()
            if cluster.state == ClusterState.STARTING:
                services.cluster_start_failed(cluster=cluster, message=message, kind=kind)
        raise


def _start(ctx: JobContext, cluster: Cluster, *, restart: bool) -> None:
    """The steps of a start; a step already done (a job taken up again after its worker died) is skipped."""
    members = cluster_members(cluster, accelerators=True, chunks=True)
    head = next(m for m in members if m.role == Role.HEAD)
    _check_agents([m for m in members if m.machine.state == MachineState.HEALTHY])
    check_token_agents([m for m in members if m.machine.state == MachineState.HEALTHY])
    _check_images_held(members)
    usable = _drop_unusable(members, head)
    with ProgressBoard(cluster) as board:
        if restart:
            usable = _stage(ctx, steps.STOP_RAY, usable, head, board, _stop_ray)
        # The firewall first: before Ray listens on its ports, and before the image moves between the machines'
        # file servers (a table another cluster left on a machine that was away at its delete would refuse them).
        usable = firewall_close(ctx, cluster, usable, head, board)
        if steps.GET_IMAGE.begin(ctx):
            usable = distribute(ctx, cluster, usable, head, board, images.runtime_files)
        usable = _stage(ctx, steps.LOAD_IMAGE, usable, head, board, _load_and_start_runtime)
        usable = _stage(ctx, steps.DELIVER_SECRETS, usable, head, board, secrets_deliver(cluster))
        usable = certificates_issue(ctx, cluster, usable, head, board)
    # Machines that dropped out in an earlier run of this job stay out of it.
    failed = set(ClusterMember.objects.filter(cluster=cluster, state=MemberState.FAILED).values_list("pk", flat=True))
    usable = [m for m in usable if m.pk not in failed or m.pk == head.pk]
    seen: list[RayStatus] = []  # Ray's node lists as the head's start and each join returned them
    if steps.START_HEAD.begin(ctx, f"{head.machine.name} at {head.address}:{cluster.ray_port}"):
        member_transition(head, to=MemberState.RAY)
        seen.append(on_member(head, lambda agent: agent.ray_start_head(address=head.address, port=cluster.ray_port,
                                                                       gpus=RAY_GPUS)))
    workers = [m for m in usable if m.role != Role.HEAD]
    with ProgressBoard(cluster) as board:
        _stage(ctx, steps.JOIN_OTHERS, workers, head, board, lambda m, b: _join(m, b, head, cluster, seen),
               detail=f"{len(workers)} machine(s)")
    steps.CHECK_RAY.always(ctx)
    joined = _check_with_ray(cluster, head, members, seen)
    ctx.detail(f"{len(joined)} of {len(members)} machines up, {sum(m.accelerators_in_ray for m in joined)} accelerators")
    node_settings_write(ctx, cluster)
    shared_files_share(ctx, cluster)
    # Running is written with the job's end, so that the moment the page reads Running nothing is busy.
    ctx.on_success(lambda: _running(cluster, reason=_left_out(members, joined)))


def _running(cluster: Cluster, *, reason: str) -> None:
    cluster.refresh_from_db()
    if cluster.state != ClusterState.STARTING:
        return  # a stop or a delete came in after the last step: theirs is the word
    cluster_transition(cluster=cluster, to=ClusterState.RUNNING, reason=reason)
    cluster.start_attempts = 0
    cluster.restart_attempt = 0
    cluster.save(update_fields=["start_attempts", "restart_attempt"])
    services.cluster_check_soon(cluster=cluster)
    hooks.cluster_running.send(sender=Cluster, cluster=cluster)


def start_abandoned(job) -> None:
    """The reaper gave up on a start: the cluster goes the way a failed start goes."""
    cluster = Cluster.objects.filter(pk=job.target_id).first()
    if cluster is not None and cluster.state == ClusterState.STARTING:
        services.cluster_start_failed(cluster=cluster, message=job.error, kind=ErrorKind.RETRYABLE)


def members_abandoned(job) -> None:
    """The reaper gave up on machines joining: they say so, and the next check looks at them."""
    members_transition(ClusterMember.objects.filter(pk__in=job.params.get("members", [])).exclude(state=MemberState.JOINED),
                       to=MemberState.FAILED, reason=job.error)


def _left_out(members: list[ClusterMember], joined: list[ClusterMember]) -> str:
    """What a Running cluster says when some machines did not join (the next check repairs them)."""
    out = [m.machine.name for m in members if m not in joined]
    if not out:
        return ""
    one = len(out) == 1
    return (f"{', '.join(out)} did not join; {'it is' if one else 'they are'} joined again once the health check finds "
            f"{'it' if one else 'them'} back.")


def cluster_add_run(ctx: JobContext, *, cluster_id: int) -> None:
    """Machines join a running cluster: each must reach the head on the cluster's network, then gets
    the image from a machine of the cluster, starts its runtime and joins Ray. The cluster keeps running."""
    cluster = Cluster.objects.get(pk=cluster_id)
    members = cluster_members(cluster, accelerators=True, chunks=True)
    head = next(m for m in members if m.role == Role.HEAD)
    wanted = set(ctx.job.params.get("members", []))
    new = [m for m in members if m.pk in wanted and m.state not in (MemberState.JOINED, MemberState.FAILED)]
    holders = [m for m in members if m.pk not in wanted and m.state == MemberState.JOINED]
    try:
        _check_agents(new)
        check_token_agents(new)
        _check_images_held(new)
        with ProgressBoard(cluster) as board:
            new = firewall_close(ctx, cluster, new, head, board, others=holders, tolerate_all=True)
            new = _stage(ctx, steps.REACH_HEAD, new, head, board, lambda m, b: _reach_head(m, b, head, cluster),
                         tolerate_all=True, detail=f"{head.machine.name} at {head.address}:{cluster.ray_port}")
            if steps.GET_IMAGE.begin(ctx):
                new = distribute(ctx, cluster, [*holders, *new], head, board, images.runtime_files, joining={m.pk for m in new})
            new = _stage(ctx, steps.LOAD_IMAGE, new, head, board, _load_and_start_runtime, tolerate_all=True)
            new = _stage(ctx, steps.DELIVER_SECRETS, new, head, board, secrets_deliver(cluster), tolerate_all=True)
            new = certificates_issue(ctx, cluster, new, head, board, tolerate_all=True)
            seen: list[RayStatus] = []
            new = _stage(ctx, steps.JOIN_RAY, new, head, board, lambda m, b: _join(m, b, head, cluster, seen), tolerate_all=True)
        steps.CHECK_RAY.always(ctx)
        joined = _check_with_ray(cluster, head, [m for m in cluster_members(cluster) if m.pk in wanted], seen)
    except JobError as exc:
        members_transition(ClusterMember.objects.filter(pk__in=wanted), to=MemberState.FAILED, reason=exc.message,
                           only_from=[s for s in MemberState if s not in (MemberState.JOINED, MemberState.FAILED)])
        cluster_changed(cluster)
        raise
    ctx.detail(f"{len(joined)} of {len(wanted)} machine(s) joined")
    node_settings_write(ctx, cluster)  # every member: the new ones are in every node's hostfile and hosts now
    shared_files_share(ctx, cluster, keep_method=True)
    if len(joined) < len(wanted):
        reasons = ClusterMember.objects.filter(pk__in=wanted, state=MemberState.FAILED).values_list("machine__name", "state_reason")
        raise JobError(" ".join(f"{name}: {reason}" if not reason.startswith(name) else reason for name, reason in reasons)
                       or "Not every machine joined.")


def cluster_rejoin_run(ctx: JobContext, *, cluster_id: int) -> None:
    """A repair: each machine that dropped out leaves Ray and joins again; the others keep serving."""
    cluster = Cluster.objects.get(pk=cluster_id)
    members = cluster_members(cluster, accelerators=True, chunks=True)
    head = next(m for m in members if m.role == Role.HEAD)
    wanted = set(ctx.job.params.get("members", []))
    again = [m for m in members if m.pk in wanted]
    with ProgressBoard(cluster) as board:
        again = _stage(ctx, steps.TAKE_OUT, again, head, board, _stop_ray, tolerate_all=True,
                       detail=", ".join(m.machine.name for m in again))
        again = _stage(ctx, steps.START_RUNTIME, again, head, board, _load_and_start_runtime, tolerate_all=True)
        again = _stage(ctx, steps.DELIVER_SECRETS, again, head, board, secrets_deliver(cluster), tolerate_all=True)
        again = certificates_issue(ctx, cluster, again, head, board, tolerate_all=True)
        again = firewall_close(ctx, cluster, again, head, board, tolerate_all=True)
        seen: list[RayStatus] = []
        again = _stage(ctx, steps.JOIN_RAY, again, head, board, lambda m, b: _join(m, b, head, cluster, seen), tolerate_all=True)
    steps.CHECK_RAY.always(ctx)
    joined = _check_with_ray(cluster, head, [m for m in cluster_members(cluster) if m.pk in wanted], seen)
    with transaction.atomic():
        cluster.refresh_from_db()
        left = [m for m in cluster_members(cluster) if m.pk in wanted and m.state != MemberState.JOINED]
        reason = ""
        if left:
            reason = " ".join(m.state_reason if m.state_reason.startswith(m.machine.name) else f"{m.machine.name}: {m.state_reason}"
                              for m in left)
            reason += " The next check tries again."
        cluster_transition(cluster=cluster, to=cluster.state, reason=reason)
    ctx.detail(f"{len(joined)} of {len(wanted)} machine(s) joined again")
    node_settings_write(ctx, cluster)
    shared_files_share(ctx, cluster, keep_method=True)
    if left:
        raise JobError(reason)


def _check_agents(members: list[ClusterMember]) -> None:
    """Every machine runs the agent this console ships: a start uses its newest commands, and an older
    agent would refuse them half way. Refresh facts installs it (a retry alone would not)."""
    version = agent_version()
    old = sorted(m.machine.name for m in members if m.machine.agent_version != version)
    if old:
        one = len(old) == 1
        raise JobError(f"{', '.join(old)} {'runs' if one else 'run'} another agent than this console's {version}: "
                       f"select Refresh facts on {'its' if one else 'their'} page, then Try again.", kind=ErrorKind.NOT_RETRYABLE)


def _check_images_held(members: list[ClusterMember]) -> None:
    """The server must hold the exact build each machine needs: a retry would not change that."""
    for member in members:
        image = member.runtime_image
        if image is None:
            raise JobError(f"No certified runtime image runs on {member.machine.name}.", kind=ErrorKind.NOT_RETRYABLE)
        if not images.runtime_image_held(image):
            raise JobError(
                f"The server holds a different build of {image} than the cluster needs (sha256 {image.digest[:12]}…). "
                "Run faden runtime-images --check on the server and fetch what is missing.",
                kind=ErrorKind.NOT_RETRYABLE,
            )


def _drop_unusable(members: list[ClusterMember], head: ClusterMember) -> list[ClusterMember]:
    """Machines that are not Healthy now, or lost their container runtime since they were picked, sit
    this start out and say why; the head cannot."""
    usable = []
    for member in members:
        machine = member.machine
        if machine.state == MachineState.HEALTHY and machine.container_runtime:
            usable.append(member)
            continue
        if machine.state == MachineState.HEALTHY:  # no retry installs Docker: a person must
            reason = machine.no_runtime()
            if member is head:
                raise JobError(reason, kind=ErrorKind.NOT_RETRYABLE)
        else:
            why = f" ({machine.state_reason.rstrip('.')})" if machine.state_reason else ""
            reason = f"{machine.name} is {machine.get_state_display().lower()}{why}."
            if member is head:
                raise JobError(f"The head {reason}", kind=ErrorKind.RETRYABLE)
        member_transition(member, to=MemberState.FAILED, reason=reason)
    return usable


def _load_and_start_runtime(member: ClusterMember, board: ProgressBoard) -> None:
    board.move(member, MemberState.LOADING)
    digest = member.runtime_image.digest
    abort = offline_reason(member.machine_id)

    def load(agent) -> None:
        _clear_leftover(member, agent)
        driver = member.machine.container_runtime
        agent.image_load(digest, driver=driver, abort=abort)
        agent.runtime_start(digest, driver=driver, cluster=member.cluster.name, abort=abort)

    on_member(member, load)


def _clear_leftover(member: ClusterMember, agent) -> None:
    """What a deleted cluster left on the machine (its Ray, its runtime) is replaced: stopped here."""
    gcs = f"{member.cluster.head_address}:{member.cluster.ray_port}"
    status = agent.runtime_status()
    leftover_ray = status.ray_running and status.gcs_address != gcs
    other_runtime = status.state == "started" and status.digest != member.runtime_image.digest
    if leftover_ray or other_runtime:
        agent.runtime_stop()


def _stop_ray(member: ClusterMember, board: ProgressBoard) -> None:
    board.move(member, MemberState.PENDING)
    on_member(member, lambda agent: agent.ray_stop(abort=offline_reason(member.machine_id)))


def _reach_head(member: ClusterMember, board: ProgressBoard, head: ClusterMember, cluster: Cluster) -> None:
    """A machine joining must reach the head on the cluster's network before anything is copied to it."""
    board.move(member, MemberState.PENDING, f"Checking that it reaches {head.machine.name} at {head.address}")
    try:
        on_member(member, lambda agent: agent.ray_reach(head=f"{head.address}:{cluster.ray_port}"))
    except JobError as exc:
        raise JobError(f"{member.machine.name} cannot reach the head {head.machine.name} on the cluster's network "
                       f"{cluster.network}: {exc.message.split(': ', 1)[-1]}", kind=exc.kind) from exc
    board.move(member, MemberState.PENDING)


def _join(member: ClusterMember, board: ProgressBoard, head: ClusterMember, cluster: Cluster, seen: list[RayStatus]) -> None:
    """Ray joined on the member; the node list its join returned goes to ``seen`` (for the check after)."""
    board.move(member, MemberState.RAY)
    seen.append(on_member(member, lambda agent: agent.ray_join(head=f"{head.address}:{cluster.ray_port}", address=member.address,
                                                               gpus=RAY_GPUS,
                                                               abort=offline_reason(member.machine_id))))


def _check_with_ray(cluster: Cluster, head: ClusterMember, members: list[ClusterMember],
                    seen: list[RayStatus] = ()) -> list[ClusterMember]:
    """Ray's own node list decides who is up; the totals count the accelerators of the machines up (the
    cluster's Ray offers none: RAY_GPUS). A list the head's start or a join already returned, holding every
    machine alive, is Ray's answer: the head is not asked the same again (each look runs a Python that
    imports Ray there)."""
    # Failures recorded by worker threads went to the database, not to these objects.
    failed = set(ClusterMember.objects.filter(cluster=cluster, state=MemberState.FAILED).values_list("pk", flat=True))
    expected = {m.address for m in members if m.pk not in failed}
    complete = [status.alive() for status in reversed(seen) if expected <= set(status.alive())]
    alive = complete[0] if complete else None
    gcs = f"{head.address}:{cluster.ray_port}"
    # A node whose join returned shows in the head's list within a few seconds: ask again before calling it out.
    for attempt in range(0 if alive is not None else RAY_LIST_TRIES):
        alive = on_member(head, lambda agent: agent.ray_status(head=gcs)).alive()
        if expected <= set(alive) or attempt == RAY_LIST_TRIES - 1:
            break
        time.sleep(RAY_LIST_PAUSE)
    if head.address not in alive:
        raise JobError(f"Ray on {head.machine.name} does not list the head as alive.")
    joined = []
    for member in members:
        node = alive.get(member.address)
        if node:
            member_transition(member, to=MemberState.JOINED, ray_node_id=node.node_id,
                              accelerators_in_ray=len(member.machine.accelerators.all()), rejoin_attempts=0)
            joined.append(member)
        elif member.pk not in failed:
            member_transition(member, to=MemberState.FAILED, reason=f"Ray on the head does not list {member.machine.name} ({member.address}).")
    return joined

