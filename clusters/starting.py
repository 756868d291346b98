"""Starting a cluster: the runtime image from the server to one machine and on machine to
machine, each machine loads it and starts its runtime, Ray starts on the head, the others join,
and the cluster reads Running once Ray's own node list holds them.

Workers run in threads, one SSH connection each. Their progress goes through one
``ProgressBoard`` that writes the database and pushes the page twice a second at most,
whatever the number of machines.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from django.db import close_old_connections, connections, transaction
from django.db.models import F

from clusters import images, planning, services
from clusters.choices import ClusterState, MemberState, Role
from clusters.models import Cluster, ClusterMember, head_first
from console.jobs import JobCancelled, JobContext, JobError
from console.ticker import Ticker
from machines import enrolment, remote
from machines.choices import MachineState
from machines.models import Machine
from machines.services import machine_target

IMAGE_PORT = 7470
PUSH_EVERY = 0.5  # seconds between two pushes of the bars
MAX_PARALLEL = 32  # SSH sessions one start holds at once


class ProgressBoard(Ticker):
    """Member fields changed by worker threads, written and pushed together on a tick."""

    tick_on_exit = True

    def __init__(self, cluster: Cluster):
        super().__init__(f"progress-{cluster.pk}")
        self.cluster = cluster
        self._lock = threading.Lock()
        self._pending: dict[int, dict] = {}

    def every(self) -> float:
        return PUSH_EVERY

    def update(self, member_id: int, **fields) -> None:
        with self._lock:
            self._pending.setdefault(member_id, {}).update(fields)

    def tick(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        for member_id, fields in pending.items():
            ClusterMember.objects.filter(pk=member_id).update(**fields)
        services.cluster_changed(self.cluster, part="members")


def _in_thread(fn: Callable, *args):
    """Run in a worker thread with a database connection of its own, closed afterwards."""
    try:
        return fn(*args)
    finally:
        connections.close_all()


def _offline_reason(*machine_ids: int) -> Callable[[], str | None]:
    """Asked while a command runs: a machine of the transfer went offline."""
    def check() -> str | None:
        close_old_connections()
        for machine in Machine.objects.filter(pk__in=machine_ids, state=MachineState.OFFLINE):
            return f"{machine.name} went offline ({machine.state_reason or 'no heartbeat'}): waiting for it to come back."
        return None
    return check


def _agent(member: ClusterMember) -> list[str]:
    if not member.machine.agent_path:
        raise remote.RemoteError(f"{member.machine.name} has no agent yet: refresh its facts.", kind="not_retryable")
    return member.machine.agent_command()


class MemberFailed(Exception):
    def __init__(self, member: ClusterMember, error: remote.RemoteError):
        super().__init__(error.message)
        self.member = member
        self.error = error


def cluster_start_run(ctx: JobContext, *, cluster_id: int) -> None:
    cluster = Cluster.objects.get(pk=cluster_id)
    try:
        _start(ctx, cluster, restart=bool(ctx.job.params.get("restart")))
    except JobCancelled:
        raise  # a stop or a delete took over: the cluster reads what they say
    except Exception as exc:
        # Whatever broke, the cluster must not stay Starting without a job behind it.
        message, kind = (exc.message, exc.kind) if isinstance(exc, JobError) else (f"Unexpected error: {exc}", "retryable")
        with transaction.atomic():
            cluster.refresh_from_db()
            if cluster.state == ClusterState.STARTING:
                services.cluster_start_failed(cluster=cluster, message=message, kind=kind)
        raise


def _members(cluster: Cluster) -> list[ClusterMember]:
    return sorted(cluster.members.select_related("machine", "runtime_image").order_by("machine__name"), key=head_first)


def _start(ctx: JobContext, cluster: Cluster, *, restart: bool) -> None:
    """The steps of a start; a step already done (a job taken up again after its worker died) is skipped."""
    members = _members(cluster)
    head = next(m for m in members if m.role == Role.HEAD)
    _check_images_held(members)
    usable = _drop_unusable(members, head)
    with ProgressBoard(cluster) as board:
        if restart:
            usable = _stage(ctx, services.RESTART_STEP, usable, head, board, _stop_ray)
        if not ctx.done("Get the runtime image"):
            ctx.step("Get the runtime image")
            usable = _distribute(ctx, cluster, usable, head, board)
        usable = _stage(ctx, "Load the image", usable, head, board, _load_and_start_runtime)
    # Machines that dropped out in an earlier run of this job stay out of it.
    failed = set(ClusterMember.objects.filter(cluster=cluster, state=MemberState.FAILED).values_list("pk", flat=True))
    usable = [m for m in usable if m.pk not in failed or m.pk == head.pk]
    if not ctx.done("Start Ray on the head"):
        ctx.step("Start Ray on the head", f"{head.machine.name} at {head.address}:{cluster.ray_port}")
        _set_member(head, state=MemberState.RAY)
        _run_on(head, ["ray", "start-head", "--address", head.address, "--port", str(cluster.ray_port),
                       "--num-gpus", str(head.machine.accelerators.count())], timeout=180)
    workers = [m for m in usable if m.role != Role.HEAD]
    with ProgressBoard(cluster) as board:
        _stage(ctx, "Join the other machines", workers, head, board, lambda m, b: _join(m, b, head, cluster),
               detail=f"{len(workers)} machine(s)")
    ctx.step("Check with Ray")
    joined = _check_with_ray(cluster, head, members)
    ctx.detail(f"{len(joined)} of {len(members)} machines up, {sum(m.accelerators_in_ray for m in joined)} accelerators")
    with transaction.atomic():
        cluster.refresh_from_db()
        services.cluster_transition(cluster=cluster, to=ClusterState.RUNNING, reason=_left_out(members, joined))
        cluster.start_attempts = 0
        cluster.restart_attempt = 0
        cluster.save(update_fields=["start_attempts", "restart_attempt"])
        services.cluster_check_soon(cluster=cluster)


def start_abandoned(job) -> None:
    """The reaper gave up on a start: the cluster goes the way a failed start goes."""
    cluster = Cluster.objects.filter(pk=job.target_id).first()
    if cluster is not None and cluster.state == ClusterState.STARTING:
        services.cluster_start_failed(cluster=cluster, message=job.error, kind="retryable")


def members_abandoned(job) -> None:
    """The reaper gave up on machines joining: they say so, and the next check looks at them."""
    ClusterMember.objects.filter(pk__in=job.params.get("members", [])).exclude(state=MemberState.JOINED).update(
        state=MemberState.FAILED, state_reason=job.error)


def _left_out(members: list[ClusterMember], joined: list[ClusterMember]) -> str:
    """What a Running cluster says when some machines did not join (the next check repairs them)."""
    out = [m.machine.name for m in members if m not in joined]
    if not out:
        return ""
    return f"{', '.join(out)} did not join; {'it is' if len(out) == 1 else 'they are'} joined again once the health check finds {'it' if len(out) == 1 else 'them'} back."


def cluster_add_run(ctx: JobContext, *, cluster_id: int) -> None:
    """Machines join a running cluster: each must reach the head on the cluster's network, then gets
    the image from a machine of the cluster, starts its runtime and joins Ray. The cluster keeps running."""
    cluster = Cluster.objects.get(pk=cluster_id)
    members = _members(cluster)
    head = next(m for m in members if m.role == Role.HEAD)
    wanted = set(ctx.job.params.get("members", []))
    new = [m for m in members if m.pk in wanted and m.state not in (MemberState.JOINED, MemberState.FAILED)]
    holders = [m for m in members if m.pk not in wanted and m.state == MemberState.JOINED]
    try:
        _check_images_held(new)
        with ProgressBoard(cluster) as board:
            new = _stage(ctx, "Check the way to the head", new, head, board, lambda m, b: _reach_head(m, b, head, cluster),
                         tolerate_all=True, detail=f"{head.machine.name} at {head.address}:{cluster.ray_port}")
            if not ctx.done("Get the runtime image"):
                ctx.step("Get the runtime image")
                new = _distribute(ctx, cluster, [*holders, *new], head, board, joining={m.pk for m in new})
            new = _stage(ctx, "Load the image", new, head, board, _load_and_start_runtime, tolerate_all=True)
            new = _stage(ctx, "Join Ray", new, head, board, lambda m, b: _join(m, b, head, cluster), tolerate_all=True)
        ctx.step("Check with Ray")
        joined = _check_with_ray(cluster, head, [m for m in _members(cluster) if m.pk in wanted])
    except JobError as exc:
        ClusterMember.objects.filter(pk__in=wanted).exclude(state__in=[MemberState.JOINED, MemberState.FAILED]).update(
            state=MemberState.FAILED, state_reason=exc.message)
        services.cluster_changed(cluster)
        raise
    ctx.detail(f"{len(joined)} of {len(wanted)} machine(s) joined")
    if len(joined) < len(wanted):
        reasons = ClusterMember.objects.filter(pk__in=wanted, state=MemberState.FAILED).values_list("machine__name", "state_reason")
        raise JobError(" ".join(f"{name}: {reason}" if not reason.startswith(name) else reason for name, reason in reasons)
                       or "Not every machine joined.")


def cluster_rejoin_run(ctx: JobContext, *, cluster_id: int) -> None:
    """A repair: each machine that dropped out leaves Ray and joins again; the others keep serving."""
    cluster = Cluster.objects.get(pk=cluster_id)
    members = _members(cluster)
    head = next(m for m in members if m.role == Role.HEAD)
    wanted = set(ctx.job.params.get("members", []))
    again = [m for m in members if m.pk in wanted]
    with ProgressBoard(cluster) as board:
        again = _stage(ctx, "Take it out of Ray", again, head, board, _stop_ray, tolerate_all=True,
                       detail=", ".join(m.machine.name for m in again))
        again = _stage(ctx, "Start its runtime", again, head, board, _load_and_start_runtime, tolerate_all=True)
        again = _stage(ctx, "Join Ray", again, head, board, lambda m, b: _join(m, b, head, cluster), tolerate_all=True)
    ctx.step("Check with Ray")
    joined = _check_with_ray(cluster, head, [m for m in _members(cluster) if m.pk in wanted])
    with transaction.atomic():
        cluster.refresh_from_db()
        left = [m for m in _members(cluster) if m.pk in wanted and m.state != MemberState.JOINED]
        reason = ""
        if left:
            reason = " ".join(m.state_reason if m.state_reason.startswith(m.machine.name) else f"{m.machine.name}: {m.state_reason}" for m in left)
            reason += " The next check tries again."
        services.cluster_transition(cluster=cluster, to=cluster.state, reason=reason)
    ctx.detail(f"{len(joined)} of {len(wanted)} machine(s) joined again")
    if left:
        raise JobError(reason)


def _check_images_held(members: list[ClusterMember]) -> None:
    """The server must hold the exact build each machine needs: a retry would not change that."""
    for member in members:
        image = member.runtime_image
        if image is None:
            raise JobError(f"No certified runtime image runs on {member.machine.name}.", kind="not_retryable")
        if not images.runtime_image_held(image):
            raise JobError(
                f"The server holds a different build of {image} than the cluster needs (sha256 {image.digest[:12]}…). "
                "Run faden runtime-images --check on the server and fetch what is missing.",
                kind="not_retryable",
            )


def _drop_unusable(members: list[ClusterMember], head: ClusterMember) -> list[ClusterMember]:
    """Machines that are not Healthy now sit this start out and say why; the head cannot."""
    usable = []
    for member in members:
        machine = member.machine
        if machine.state == MachineState.HEALTHY:
            usable.append(member)
            continue
        why = f" ({machine.state_reason.rstrip('.')})" if machine.state_reason else ""
        reason = f"{machine.name} is {machine.get_state_display().lower()}{why}."
        if member is head:
            raise JobError(f"The head {reason}", kind="retryable")
        _set_member(member, state=MemberState.FAILED, state_reason=reason)
    return usable


def _set_member(member: ClusterMember, **fields) -> None:
    for name, value in fields.items():
        setattr(member, name, value)
    ClusterMember.objects.filter(pk=member.pk).update(**fields)
    services.cluster_changed(member.cluster, part="members")


def _run_on(member: ClusterMember, argv: list[str], *, timeout: float, stdin: bytes | None = None, on_event=None, abort=None) -> dict:
    try:
        with remote.connect(machine_target(member.machine)) as conn:
            return remote.run_agent(conn, [*_agent(member), *argv], timeout=timeout, stdin=stdin, on_event=on_event, abort=abort)
    except remote.RemoteError as exc:
        raise JobError(f"{member.machine.name}: {exc.message}", kind=exc.kind) from exc


def _parallel(members, head, board, work, *, tolerate_all: bool = False) -> list[ClusterMember]:
    """Run ``work(member, board)`` on every member at once. A worker that is unreachable drops out
    (it says why); any other failure, or the head failing, fails the start. With ``tolerate_all``
    (machines joining a running cluster) any worker's failure only takes that worker out."""
    failures: list[tuple[ClusterMember, JobError]] = []

    def one(member):
        try:
            work(member, board)
        except JobError as exc:
            failures.append((member, exc))
            board.update(member.pk, state=MemberState.FAILED, state_reason=exc.message)

    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, max(1, len(members)))) as pool:
        list(pool.map(lambda m: _in_thread(one, m), members))
    for member, exc in failures:
        if member.pk == head.pk or (exc.kind != "unreachable" and not tolerate_all):
            raise exc
    failed = {m.pk for m, _ in failures}
    return [m for m in members if m.pk not in failed]


def _stage(ctx: JobContext, name: str, members, head, board, work, *, tolerate_all: bool = False, detail: str = ""):
    """One step of a job, run on every member at once; a step done in an earlier run of the job is skipped."""
    if ctx.done(name):
        return members
    ctx.step(name, detail)
    return _parallel(members, head, board, work, tolerate_all=tolerate_all)


# -- the image ------------------------------------------------------------------------------------


def _distribute(ctx: JobContext, cluster: Cluster, members: list[ClusterMember], head, board,
                joining: set[int] | None = None) -> list[ClusterMember]:
    """One copy from the server per build, then machine to machine in a chain, forwarded as it arrives.
    With ``joining`` (members joining a running cluster), the others only give: the result holds the joining."""
    by_id = {m.machine_id: m for m in members}
    receivers = [
        planning.Receiver(id=m.machine_id, platform=m.runtime_image.digest, has_image=m.image_bytes_done == m.runtime_image.size_bytes > 0)
        for m in members
    ]
    transfers = planning.distribution_plan(receivers)
    # Every machine serves what it holds on the cluster's network, so that the next one can fetch from it.
    members = _parallel(members, head, board, _serve_images)
    serving = {m.machine_id for m in members}
    with remote.connect(machine_target(head.machine)) as conn:
        console = enrolment.console_url(conn)
    ctx.detail(f"{len(transfers)} transfer(s); one copy from the server per build")

    def fetch(member: ClusterMember, board: ProgressBoard) -> None:
        transfer = next(t for t in transfers if t.machine_id == member.machine_id)
        image = member.runtime_image
        if transfer.source == "server":
            url = f"{console}/agent/images/{image.digest}/"
            source = {"url": url, "token": images.image_download_token(digest=image.digest, cluster_id=cluster.pk)}
            label, watch = "the server", (member.machine_id,)
        else:
            giver = by_id[transfer.source]
            if giver.machine_id not in serving:
                raise JobError(f"{member.machine.name} waits for the image from {giver.machine.name}, which is not reachable.", kind="unreachable")
            source = {"url": f"http://{giver.address}:{IMAGE_PORT}/images/{image.digest}"}
            label, watch = f"{giver.machine.name} ({giver.address})", (member.machine_id, giver.machine_id)
        spec = {"digest": image.digest, "size": image.size_bytes, "chunk_size": image.chunk_size,
                "chunk_hashes": image.chunk_hashes, "source": source}
        board.update(member.pk, state=MemberState.IMAGE, state_reason="", image_source=label, image_bytes_total=image.size_bytes)

        def on_event(event: dict) -> None:
            if event.get("event") == "progress":
                board.update(member.pk, image_bytes_done=int(event.get("bytes", 0)), image_rate=float(event.get("rate", 0)))

        result = _run_on(member, ["image", "fetch"], stdin=json.dumps(spec).encode(), on_event=on_event,
                         timeout=image.size_bytes / 1_000_000 + 300, abort=_offline_reason(*watch))
        board.update(member.pk, image_bytes_done=image.size_bytes, image_rate=0,
                     image_bytes_fetched=F("image_bytes_fetched") + int(result.get("bytes_fetched", 0)))

    receiving = {t.machine_id for t in transfers}
    fetched = _parallel([m for m in members if m.machine_id in receiving], head, board, fetch, tolerate_all=joining is not None)
    result = fetched + [m for m in members if m.machine_id not in receiving]
    return [m for m in result if m.pk in joining] if joining is not None else result


def _serve_images(member: ClusterMember, board: ProgressBoard) -> None:
    _run_on(member, ["image", "serve", "start", "--bind", member.address, "--port", str(IMAGE_PORT)], timeout=30)


def _load_and_start_runtime(member: ClusterMember, board: ProgressBoard) -> None:
    board.update(member.pk, state=MemberState.LOADING)
    _clear_leftover(member)
    digest = member.runtime_image.digest
    _run_on(member, ["image", "load", "--digest", digest], timeout=120, abort=_offline_reason(member.machine_id))
    _run_on(member, ["runtime", "start", "--digest", digest], timeout=120, abort=_offline_reason(member.machine_id))


def _clear_leftover(member: ClusterMember) -> None:
    """What a deleted cluster left on the machine (its Ray, its runtime) is replaced: stopped here."""
    gcs = f"{member.cluster.head_address}:{member.cluster.ray_port}"
    status = _run_on(member, ["runtime", "status"], timeout=30)
    ray = status.get("ray") or {}
    leftover_ray = ray.get("running") and ray.get("gcs_address") != gcs
    other_runtime = status.get("state") == "started" and status.get("digest") != member.runtime_image.digest
    if leftover_ray or other_runtime:
        _run_on(member, ["runtime", "stop"], timeout=60)


def _stop_ray(member: ClusterMember, board: ProgressBoard) -> None:
    board.update(member.pk, state=MemberState.PENDING, state_reason="")
    _run_on(member, ["ray", "stop"], timeout=60, abort=_offline_reason(member.machine_id))


def _reach_head(member: ClusterMember, board: ProgressBoard, head: ClusterMember, cluster: Cluster) -> None:
    """A machine joining must reach the head on the cluster's network before anything is copied to it."""
    board.update(member.pk, state=MemberState.PENDING, state_reason=f"Checking that it reaches {head.machine.name} at {head.address}")
    try:
        _run_on(member, ["ray", "reach", "--head", f"{head.address}:{cluster.ray_port}"], timeout=30)
    except JobError as exc:
        raise JobError(f"{member.machine.name} cannot reach the head {head.machine.name} on the cluster's network "
                       f"{cluster.network}: {exc.message.split(': ', 1)[-1]}", kind=exc.kind) from exc
    board.update(member.pk, state_reason="")


# -- Ray -------------------------------------------------------------------------------------------


def _join(member: ClusterMember, board: ProgressBoard, head: ClusterMember, cluster: Cluster) -> None:
    board.update(member.pk, state=MemberState.RAY)
    _run_on(member, ["ray", "join", "--head", f"{head.address}:{cluster.ray_port}", "--address", member.address,
                     "--num-gpus", str(member.machine.accelerators.count())], timeout=180, abort=_offline_reason(member.machine_id))


def _check_with_ray(cluster: Cluster, head: ClusterMember, members: list[ClusterMember]) -> list[ClusterMember]:
    """Ray's own node list decides who is up; the totals count what Ray reports."""
    nodes = _run_on(head, ["ray", "status", "--head", f"{head.address}:{cluster.ray_port}"], timeout=60)["nodes"]
    alive = {n["address"]: n for n in nodes if n.get("alive")}
    if head.address not in alive:
        raise JobError(f"Ray on {head.machine.name} does not list the head as alive.")
    joined = []
    # Failures recorded by worker threads went to the database, not to these objects.
    failed = set(ClusterMember.objects.filter(cluster=cluster, state=MemberState.FAILED).values_list("pk", flat=True))
    for member in members:
        node = alive.get(member.address)
        if node:
            _set_member(member, state=MemberState.JOINED, state_reason="", ray_node_id=node.get("node_id", "")[:64],
                        accelerators_in_ray=int(node.get("gpus") or 0))
            joined.append(member)
        elif member.pk not in failed:
            _set_member(member, state=MemberState.FAILED, state_reason=f"Ray on the head does not list {member.machine.name} ({member.address}).")
    return joined
