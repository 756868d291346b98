"""Doing one thing on every machine of a cluster at once: threads with their own database
connections, one ``ProgressBoard`` that writes and pushes their progress together, and the rule
for who drops out when a machine fails.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

from django.db import close_old_connections, connections

from clusters.choices import MemberState
from clusters.lifecycle import cluster_changed, members_transition
from clusters.models import Cluster, ClusterMember, Transfer
from console.choices import ErrorKind
from console.jobs import JobError
from console.ticker import Ticker
from machines.agent_client import Agent, AgentError
from machines.choices import MachineState
from machines.models import Machine

PUSH_EVERY = 0.5  # seconds between two pushes of the bars
MAX_PARALLEL = 32  # SSH sessions one operation holds at once


class ProgressBoard(Ticker):
    """What worker threads report (states, transfer progress), written and pushed together on a tick,
    so that a start pushes the page twice a second at most, whatever the number of machines."""

    tick_on_exit = True

    def __init__(self, cluster: Cluster, *, also_push: Callable[[], None] | None = None):
        super().__init__(f"progress-{cluster.pk}")
        self.cluster = cluster
        self.also_push = also_push  # other pages that show these bars (a deployment's), pushed on the same tick
        self._lock = threading.Lock()
        self._transfers: dict[tuple[int, str], dict] = {}
        self._dirty = False

    def every(self) -> float:
        return PUSH_EVERY

    def move(self, member: ClusterMember, to: str, reason: str = "") -> None:
        """A member's new state, through the guard at once (states change a few times a start); pushed on the tick."""
        members_transition(ClusterMember.objects.filter(pk=member.pk), to=to, reason=reason, push=False)
        member.state, member.state_reason = to, reason
        with self._lock:
            self._dirty = True

    def transfer(self, member: ClusterMember, digest: str, **fields) -> None:
        """A file's progress to a member (bytes_done, rate, ...), written on the tick."""
        with self._lock:
            self._transfers.setdefault((member.pk, digest), {}).update(fields)

    def tick(self) -> None:
        with self._lock:
            transfers, self._transfers = self._transfers, {}
            dirty, self._dirty = self._dirty, False
        for (member_id, digest), fields in transfers.items():
            Transfer.objects.filter(member_id=member_id, digest=digest).update(**fields)
        if transfers or dirty:
            cluster_changed(self.cluster, part="members")
            if self.also_push is not None:
                self.also_push()


def in_thread(fn: Callable, *args):
    """Run in a worker thread with a database connection of its own, closed afterwards."""
    try:
        return fn(*args)
    finally:
        connections.close_all()


def offline_reason(*machine_ids: int) -> Callable[[], str | None]:
    """Asked while a command runs: a machine of it went offline (the command ends as unreachable)."""
    def check() -> str | None:
        close_old_connections()
        for machine in Machine.objects.filter(pk__in=machine_ids, state=MachineState.OFFLINE):
            return f"{machine.name} went offline ({machine.state_reason or 'no heartbeat'}): waiting for it to come back."
        return None
    return check


def on_member(member: ClusterMember, call: Callable[[Agent], object]):
    """``call`` with the member's agent; an agent's failure becomes a JobError naming the machine."""
    try:
        with Agent.open(member.machine) as agent:
            return call(agent)
    except AgentError as exc:
        raise JobError(f"{member.machine.name}: {exc.message}", kind=exc.kind) from exc


def parallel(members: Sequence[ClusterMember], head: ClusterMember, board: ProgressBoard,
             work: Callable[[ClusterMember, ProgressBoard], None], *, tolerate_all: bool = False,
             fail_state: str | None = MemberState.FAILED, failed: dict[int, str] | None = None) -> list[ClusterMember]:
    """Run ``work(member, board)`` on every member at once; the members that are still in afterwards.

    A worker that is unreachable drops out (it says why); any other failure, or the head failing,
    fails the operation. With ``tolerate_all`` (machines joining a running cluster, a repair) any
    worker's failure only takes that worker out. A member that fails moves to ``fail_state`` (None: it
    keeps its state, as when a model's files did not reach it), and ``failed`` gets why, by member id."""
    failures: list[tuple[ClusterMember, JobError]] = []

    def one(member: ClusterMember) -> None:
        try:
            work(member, board)
        except JobError as exc:
            failures.append((member, exc))
            if failed is not None:
                failed[member.pk] = exc.message
            if fail_state is not None:
                board.move(member, fail_state, exc.message)

    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, max(1, len(members)))) as pool:
        list(pool.map(lambda m: in_thread(one, m), members))
    for member, exc in failures:
        if member.pk == head.pk or (exc.kind != ErrorKind.UNREACHABLE and not tolerate_all):
            raise exc
    failed = {m.pk for m, _ in failures}
    return [m for m in members if m.pk not in failed]


def each(members: Sequence[ClusterMember], work: Callable[[ClusterMember], str | None]) -> list[str]:
    """Run ``work`` on every member at once; the failures it returned, in words."""
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, max(1, len(members)))) as pool:
        return [f for f in pool.map(lambda m: in_thread(work, m), members) if f]



Outcome = tuple[object, AgentError | None]  # the agent's answer, or why there is none


def on_every_agent(machines: Sequence[Machine], call: Callable[[Agent], object]) -> dict[int, Outcome]:
    """``call`` with each machine's agent, all at once; what each answered or raised, by machine id."""
    outcomes: dict[int, Outcome] = {}

    def one(machine: Machine) -> None:
        try:
            with Agent.open(machine) as agent:
                outcomes[machine.pk] = (call(agent), None)
        except AgentError as exc:
            outcomes[machine.pk] = (None, exc)

    each(machines, one)
    return outcomes


def missed_by(machines: Sequence[Machine], call: Callable[[Agent], object]) -> list[tuple[Machine, str]]:
    """``call`` on every machine that is not offline, all at once (``on_every_agent``); the machines it was not
    done on, each with why in a few words ("it is offline", or its agent's own words)."""
    outcomes = on_every_agent([m for m in machines if m.state != MachineState.OFFLINE], call)
    missed: list[tuple[Machine, str]] = []
    for machine in machines:
        if machine.state == MachineState.OFFLINE:
            missed.append((machine, "it is offline"))
        elif (error := outcomes[machine.pk][1]) is not None:
            missed.append((machine, error.message.rstrip(".")))
    return missed
