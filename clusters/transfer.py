"""Getting content-addressed files onto a cluster's machines: one copy from the server per file,
then machine to machine in a chain, each forwarding what it has verified while it still receives.

Any file the server holds with a digest, a size and the digest of each chunk
travels this way: runtime images today, model files next. Each machine's
progress is kept per file (``Transfer`` rows), so a machine can show several
bars. The agent verifies every chunk as it arrives and resumes a dropped
transfer at its last verified chunk; the server only plans and watches.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from django.conf import settings
from django.db.models import F

from clusters import files_token, planning
from clusters.choices import MemberState
from clusters.fanout import ProgressBoard, in_thread, on_member, offline_reason, parallel
from clusters.models import Cluster, ClusterMember, Transfer
from console import agent_tls
from console.choices import ErrorKind
from console.jobs import JobContext, JobError
from machines.agent_client import Agent, FileSource, FileSpec
from machines.versions import agent_outdated

SERVE_PORT = 7470  # where every machine serves the files it holds, on the cluster's network


@dataclass(frozen=True)
class ServerFile:
    """A file the server holds and hands out: what it is, and how a machine downloads the first copy."""

    spec: FileSpec
    what: str  # in words, for the bar: "the runtime image"
    download_path: str  # on the console: /agent/images/<digest>/
    # A fresh download token for the first copy, to the member this ServerFile was made for, good for that
    # many seconds (the fetch's time limit).
    token: Callable[[float], str]


TLS_AGENT = "0.10.0"  # the first agent that fetches from the console over TLS to its pinned certificate


@dataclass(frozen=True)
class ConsoleOrigin:
    """The console as the machines reach it for the first copies: over TLS to its agents' certificate,
    pinned, for 0.10.0 agents; over plain HTTP for older ones only where FADEN_AGENT_PLAIN_HTTP allows it."""

    plain: str
    tls: str
    pin: str

    def source(self, machine, path: str, token: str) -> FileSource:
        if not agent_outdated(machine.agent_version, TLS_AGENT):
            return FileSource(url=f"{self.tls}{path}", token=token, pin=self.pin)
        if settings.FADEN_AGENT_PLAIN_HTTP:
            return FileSource(url=f"{self.plain}{path}", token=token)
        raise JobError(f"{machine.name} has agent {machine.agent_version or 'of an unknown version'}, which fetches "
                       f"from the console over plain HTTP, and this console refuses it: update its agent (Update "
                       f"agent), or set FADEN_AGENT_PLAIN_HTTP=true.", kind=ErrorKind.NOT_RETRYABLE)


def files_held(member: ClusterMember, files: Sequence[ServerFile]) -> dict[str, bool]:
    """Which of the files the member holds whole, by digest (from its transfers)."""
    done = {t.digest for t in member.transfers.all() if t.complete}
    return {f.spec.digest: f.spec.digest in done for f in files}


def transfers_reset(member_ids: Sequence[int], *, keep: Sequence[str] = ()) -> None:
    """Forget the members' transfers (a switch of build, say), but for the files still wanted."""
    Transfer.objects.filter(member_id__in=member_ids).exclude(digest__in=list(keep)).delete()


def distribute(ctx: JobContext, cluster: Cluster, members: list[ClusterMember], head: ClusterMember, board: ProgressBoard,
               files_of: Callable[[ClusterMember], Sequence[ServerFile]], *, joining: set[int] | None = None,
               receiving_state: str | None = MemberState.IMAGE, failed: dict[int, str] | None = None) -> list[ClusterMember]:
    """Give every member the files ``files_of`` names, and return the members that have them.

    With ``joining`` (members joining a running cluster), the others only give: the result holds the joining.
    A receiving member moves to ``receiving_state`` (None: it keeps its state, as a running member
    receiving a model's files does, and keeps it when its files do not arrive: ``failed`` says why)."""
    wanted = {m.pk: list(files_of(m)) for m in members}
    plans: dict[str, list[planning.Transfer]] = {}
    for digest in {f.spec.digest for files in wanted.values() for f in files}:
        receivers = [planning.Receiver(id=m.machine_id, platform=digest, has_image=files_held(m, wanted[m.pk])[digest])
                     for m in members if any(f.spec.digest == digest for f in wanted[m.pk])]
        plans[digest] = planning.distribution_plan(receivers)
    # Every machine serves what it holds on the cluster's network, so that the next one can fetch from it;
    # the head says in the same session where the machines reach the console (the first copies' source).
    found: dict[str, str] = {}
    token = files_token.files_token(cluster)

    def serve(member: ClusterMember, board: ProgressBoard) -> None:
        def call(agent: Agent) -> None:
            agent.serve_start(bind=member.address, port=SERVE_PORT,
                              token=token if files_token.takes_token(member.machine) else None)
            if member.pk == head.pk:
                found["console"] = agent.console_url()
                found["console_tls"] = agent.agent_console_url()
        on_member(member, call)

    fail_state = MemberState.FAILED if receiving_state is not None else None
    members = parallel(members, head, board, serve, fail_state=fail_state, failed=failed)
    serving = {m.machine_id for m in members}
    console = ConsoleOrigin(plain=found["console"], tls=found["console_tls"], pin=agent_tls.pin())
    count = sum(len(plan) for plan in plans.values())
    ctx.detail(f"{count} transfer(s); one copy from the server per file")
    by_machine = {m.machine_id: m for m in members}
    sources = {(t.machine_id, digest): t.source for digest, plan in plans.items() for t in plan}

    def fetch_all(member: ClusterMember, board: ProgressBoard) -> None:
        """The member's files: the first (``files_of`` puts the largest first) over one SSH connection, the
        others one after the other over a second at the same time, so that a model's small files ride
        along with its weights instead of after them."""
        todo = [(file, source) for file in wanted[member.pk]
                if (source := sources.get((member.machine_id, file.spec.digest))) is not None]

        def fetch(part) -> None:
            on_member(member, lambda agent: [
                _fetch(agent, member, file, source, board, console=console, by_machine=by_machine, serving=serving,
                       state=receiving_state, token=token) for file, source in part])

        if len(todo) > 1:
            with ThreadPoolExecutor(max_workers=2) as pool:
                for future in [pool.submit(in_thread, fetch, todo[:1]), pool.submit(in_thread, fetch, todo[1:])]:
                    future.result()
        elif todo:
            fetch(todo)

    receiving = {machine_id for machine_id, _ in sources}
    fetched = parallel([m for m in members if m.machine_id in receiving], head, board, fetch_all, tolerate_all=joining is not None,
                       fail_state=fail_state, failed=failed)
    result = fetched + [m for m in members if m.machine_id not in receiving]
    return [m for m in result if m.pk in joining] if joining is not None else result


def _fetch(agent: Agent, member: ClusterMember, file: ServerFile, source, board: ProgressBoard, *, console: ConsoleOrigin,
           by_machine: dict[int, ClusterMember], serving: set[int], state: str | None, token: str = "") -> None:
    """One file to one member, from the server or from the machine before it in the chain."""
    spec = file.spec
    timeout = spec.size / 1_000_000 + 300  # seconds: 1 MB/s at the least, and five minutes to begin
    if source == planning.SERVER:
        origin = console.source(member.machine, file.download_path, file.token(timeout))
        label, watch = "the server", (member.machine_id,)
    else:
        giver = by_machine[source]
        if giver.machine_id not in serving:
            raise JobError(f"{member.machine.name} waits for {file.what} from {giver.machine.name}, which is not reachable.",
                           kind=ErrorKind.UNREACHABLE)
        # The cluster's token, to a server that requires it (files_token.py).
        origin = FileSource(url=f"http://{giver.address}:{SERVE_PORT}/blobs/{spec.digest}",
                            token=token if files_token.takes_token(giver.machine) else "")
        label, watch = f"{giver.machine.name} ({giver.address})", (member.machine_id, giver.machine_id)
    Transfer.objects.update_or_create(member=member, digest=spec.digest,
                                      defaults={"what": file.what, "source": label, "bytes_total": spec.size})
    if state is not None:
        board.move(member, state)

    def on_progress(event: dict) -> None:
        board.transfer(member, spec.digest, bytes_done=int(event.get("bytes", 0)), rate=float(event.get("rate", 0)))

    fetched = agent.file_fetch(spec, origin, timeout=timeout, on_progress=on_progress, abort=offline_reason(*watch))
    board.transfer(member, spec.digest, bytes_done=spec.size, rate=0)
    Transfer.objects.filter(member=member, digest=spec.digest).update(bytes_fetched=F("bytes_fetched") + fetched)
