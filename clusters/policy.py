"""Pure decisions for a cluster's life once it exists: what a health check found, what to do
about it, how restarts count up to Failed, what Delete does, and who may join a running cluster.

Plain data in, plain data out, like planning.py: no models, no database, no I/O. The
services and the health check turn rows and agent answers into the dataclasses below.
"""
from __future__ import annotations

import ipaddress
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from clusters import planning

# ------------------------------------------------------------------ what a check finds

HEAD_DOWN = "head_down"  # the head's Ray, its agent or the machine itself stopped: the whole cluster restarts
OFFLINE = "offline"  # a worker's machine went offline: nothing is repaired until it reconnects
OUT_OF_RAY = "out_of_ray"  # a worker is not (or no longer) a live node of the cluster's Ray: it joins again
NO_ANSWER = "no_answer"  # a worker's agent is silent while Ray still lists it: nothing to repair yet, said all the same

HEALTHY = "healthy"  # machine states, as machines.choices spells them
MACHINE_OFFLINE = "offline"


@dataclass(frozen=True)
class MemberLook:
    """One member as a check saw it: its machine's heartbeat, its agent's answer, Ray's node list."""

    member_id: Hashable
    name: str
    is_head: bool
    machine_state: str = HEALTHY
    machine_reason: str = ""
    answered: bool = True  # its agent answered over SSH
    error: str = ""  # why it did not
    ray_running: bool | None = None  # the agent sees Ray's processes of this cluster running
    in_ray: bool | None = None  # alive in the head's node list; None when the head's Ray did not answer


@dataclass(frozen=True)
class Look:
    members: tuple[MemberLook, ...]
    head_answered: bool = True  # Ray on the head gave its node list
    head_error: str = ""


@dataclass(frozen=True)
class Finding:
    member_id: Hashable
    machine: str
    problem: str
    text: str


def _sentence(text: str) -> str:
    text = text.strip().rstrip(".")
    return text + "." if text else ""


def anyone_answered(look: Look) -> bool:
    """A check that nobody answered says nothing about the cluster: the console's own network may be down."""
    return look.head_answered or any(m.answered for m in look.members)


def diagnose(look: Look) -> list[Finding]:
    """Every problem in the look, the head's first; an empty list is a healthy cluster."""
    findings = []
    head = next((m for m in look.members if m.is_head), None)
    if head is not None:
        text = ""
        if head.machine_state == MACHINE_OFFLINE:
            text = f"The head {head.name} is offline" + (f" ({head.machine_reason.rstrip('.')})" if head.machine_reason else "") + "."
        elif not head.answered:
            text = f"The head {head.name} does not answer: {_sentence(head.error)}"
        elif head.ray_running is False:
            text = f"Ray is not running on the head {head.name}."
        elif not look.head_answered:
            text = f"Ray on the head {head.name} does not answer: {_sentence(look.head_error)}"
        if text:
            findings.append(Finding(head.member_id, head.name, HEAD_DOWN, text))
    for member in look.members:
        if member.is_head:
            continue
        if member.machine_state == MACHINE_OFFLINE:
            reason = f" ({member.machine_reason.rstrip('.')})" if member.machine_reason else ""
            findings.append(Finding(member.member_id, member.name, OFFLINE, f"{member.name} is offline{reason}."))
        elif member.ray_running is False:
            findings.append(Finding(member.member_id, member.name, OUT_OF_RAY, f"Ray is not running on {member.name}."))
        elif member.in_ray is False:
            why = "" if member.answered else f" and its agent does not answer ({member.error.rstrip('.')})"
            findings.append(Finding(member.member_id, member.name, OUT_OF_RAY, f"Ray's node list does not hold {member.name} as alive{why}."))
        elif not member.answered:
            findings.append(Finding(member.member_id, member.name, NO_ANSWER,
                                    f"{member.name} does not answer ({member.error.rstrip('.')}); Ray still lists it."))
    return findings


# ------------------------------------------------------------------ what to do about it

LOOK_AGAIN = "look_again"
REPAIR = "repair"
WAITING = "waiting"
UNANSWERED = "unanswered"
ALL_WELL = "healthy"


@dataclass(frozen=True)
class Decision:
    outcome: str  # one of the names above (CheckOutcome's values)
    action: str  # what the check did, in words the page shows
    restart: bool = False  # restart the whole cluster (the head stopped)
    rejoin: tuple = ()  # member ids to take out of Ray and join again
    waiting_for: tuple[str, ...] = ()  # machine names the cluster waits for
    given_up: tuple = ()  # member ids that were joined again ``attempts`` times in vain: they read failed and wait


def gave_up_words(name: str, attempts: int, found: str) -> str:
    """What a machine that repairs could not join again says (on its row and on the cluster)."""
    return (f"{name} did not stay in Ray after {attempts} attempts to join it again: {_sentence(found)} "
            "Take it out of the cluster, or fix it; it is joined again once a check finds it back.")


def restart_words(attempt: int, attempts: int) -> str:
    return f"Restarting the cluster (attempt {attempt} of {attempts})"


def decide(findings: Sequence[Finding], *, answered: bool, second_look: bool, look_again_after: int,
           restart_attempt: int = 0, attempts: int = 3, exhausted: Iterable[Hashable] = (),
           look_again_when: str = "") -> Decision:
    """Restart nothing unless something is wrong, and nothing before a second look; no repair of a worker
    while a machine is offline; a head that stopped restarts the whole cluster, a worker that dropped
    out joins again, but not more than ``attempts`` times in a row (``exhausted``: members that had
    theirs): those read failed and wait. A check nobody answered changes nothing. ``look_again_when``
    says when the second look comes ("at lab-b's next heartbeat"); by default ``look_again_after`` s."""
    when = look_again_when or f"in {look_again_after} s"
    if not answered:
        return Decision(UNANSWERED, "No machine answered the check, so nothing was restarted: the fault may be "
                                    "between the console and the machines. Looking again at the next check.")
    if not findings:
        return Decision(ALL_WELL, "Nothing to do: Ray on the head lists every machine, and every agent answered.")
    head = [f for f in findings if f.problem == HEAD_DOWN]
    offline = [f.machine for f in findings if f.problem == OFFLINE]
    exhausted = set(exhausted)
    given_up = [f for f in findings if f.problem == OUT_OF_RAY and f.member_id in exhausted]
    dropped = [f for f in findings if f.problem == OUT_OF_RAY and f.member_id not in exhausted]
    silent = [f.machine for f in findings if f.problem == NO_ANSWER]
    if head:
        if not second_look:
            return Decision(LOOK_AGAIN, f"Looking again {when} before restarting the cluster: a slow answer is not a dead head.")
        return Decision(REPAIR, f"{restart_words(restart_attempt + 1, attempts)}: {head[0].text}", restart=True)
    if offline:
        names = " and ".join(offline) if len(offline) < 3 else ", ".join(offline[:-1]) + f" and {offline[-1]}"
        verb = "reconnects" if len(offline) == 1 else "reconnect"
        return Decision(WAITING, f"No repair while a machine is offline: waiting until {names} {verb}.", waiting_for=tuple(offline))
    if not dropped and given_up:
        return Decision(WAITING, " ".join(gave_up_words(f.machine, attempts, f.text) for f in given_up),
                        given_up=tuple(f.member_id for f in given_up))
    if not dropped:
        names = ", ".join(silent)
        return Decision(WAITING, f"Nothing to repair while Ray still lists {names}: waiting for {'it' if len(silent) == 1 else 'them'} to answer.",
                        waiting_for=tuple(silent))
    names = ", ".join(f.machine for f in dropped)
    if not second_look:
        return Decision(LOOK_AGAIN, f"Looking again {when} before joining {names} again.")
    return Decision(REPAIR, f"Taking {names} out of Ray and joining {'it' if len(dropped) == 1 else 'them'} again; "
                            "the other machines keep serving.", rejoin=tuple(f.member_id for f in dropped),
                    given_up=tuple(f.member_id for f in given_up))


# ------------------------------------------------------------------ restarts, then Failed

RETRYING = "retrying"
FAILED = "failed"


@dataclass(frozen=True)
class RestartOutcome:
    state: str  # RETRYING or FAILED
    pause: int  # seconds until the next try
    reason: str


def restart_failed(message: str, *, attempt: int, attempts: int, first_pause: int, failed_retry: int) -> RestartOutcome:
    """Restart ``attempt`` failed: the next attempt after a pause that doubles, or Failed after the last one,
    tried again every ``failed_retry`` seconds from then on."""
    message = _sentence(message)
    if attempt < attempts:
        pause = first_pause * 2 ** (max(1, attempt) - 1)
        return RestartOutcome(RETRYING, pause, f"Restart {attempt} of {attempts} failed: {message} "
                                                f"{restart_words(attempt + 1, attempts)} in {pause} s.")
    return RestartOutcome(FAILED, failed_retry, f"The cluster did not come back after {attempts} restarts: {message} "
                                                f"It is tried again every {every(failed_retry)}; select Try again to start over now.")


def every(seconds: int) -> str:
    """"15 minutes", or "90 s" when the minutes would not be whole."""
    return f"{seconds // 60} minutes" if seconds >= 120 and seconds % 60 == 0 else f"{seconds} s"


def seen_twice(findings: Sequence[Finding], first_look: Iterable[tuple[str, str]]) -> bool:
    """A second look confirms a first only when it found nothing new: each problem, on its machine,
    was there the first time. Anything new is looked at twice in its turn."""
    before = set(first_look)
    return all((f.machine, f.problem) in before for f in findings)


# ------------------------------------------------------------------ delete

DELETE_NOW = "now"  # no machine of it answers: the record goes at once
DELETE_AFTER_STOP = "after_stop"  # stop it on the machines that answer, then the record goes


def delete_plan(*, members: int, machines_online: int) -> str:
    """How Delete goes: a job whenever a machine of the cluster answers, running or stopped (a stop first,
    harmless on a stopped machine, then its node settings and /shared taken off the machines); at once
    when none can answer (no members, or all offline)."""
    if not members or not machines_online:
        return DELETE_NOW
    return DELETE_AFTER_STOP


# ------------------------------------------------------------------ add machines to a running cluster

@dataclass(frozen=True)
class JoinVerdict(planning.Verdict):
    address: str | None = None  # its address on the cluster's network, the one it would join with; None when it has none


def join_check(candidates: Sequence[planning.Candidate], builds: Iterable[planning.ImageBuild], *, head_id: Hashable,
               network: str, members: Iterable[Hashable], major: str = "2",
               running: Mapping[tuple[str, str], Hashable] | None = None) -> dict[Hashable, JoinVerdict]:
    """The wizard's verdicts, plus: a machine must have an address on the cluster's network to join it
    (each verdict carries that address, worked out once). Machines already in this cluster are left
    out. A machine of a platform the cluster runs gets the build the cluster runs there (``running``:
    (arch, vendor) -> build id), not a newer one: a cluster keeps its runtime until it is switched."""
    members = set(members)
    builds = list(builds)
    by_id = {b.id: b for b in builds}
    head = next((c for c in candidates if c.id == head_id), None)
    others = [c for c in candidates if c.id not in members]
    verdicts = planning.pick_check([*others, *([head] if head else [])], builds, head_id=head_id, major=major)
    subnet = ipaddress.ip_network(network, strict=False) if network else None
    result = {}
    for candidate in others:
        verdict = verdicts[candidate.id]
        same = by_id.get((running or {}).get((candidate.arch, (candidate.accelerator_vendor or "").lower())))
        runtime = same if verdict.runtime is not None and same is not None else verdict.runtime
        address = _address_in(candidate, subnet) if subnet is not None else None
        selectable, refusal = verdict.selectable, verdict.refusal
        if selectable and subnet is not None and address is None:
            selectable, refusal = False, f"{candidate.name} has no address on the cluster's network {network}."
        result[candidate.id] = JoinVerdict(selectable=selectable, refusal=refusal, warning=verdict.warning,
                                           runtime_label=verdict.runtime_label, runtime=runtime, address=address)
    return result


def cluster_address(candidate: planning.Candidate, network: str) -> str | None:
    """The candidate's address on ``network`` (without its prefix), or None."""
    return _address_in(candidate, ipaddress.ip_network(network, strict=False))


def _address_in(candidate: planning.Candidate, subnet) -> str | None:
    for net, _iface, interface in planning.subnets_of(candidate):
        if net == subnet:
            return str(interface.ip)
    return None


def next_head(candidates: Sequence[planning.Candidate]) -> Hashable | None:
    """Who leads once the head left a stopped cluster's record: the one with the most accelerators."""
    return planning.suggest_head(candidates)

