"""The drain plan: where each copy on the machines to drain goes, or why it stops (the product's "Drain a
machine" and "Remove a machine from a cluster").

Plain data in, plain data out (no Django, no I/O), built on placement: the cluster's machines as
placement sees them (``MachineRoom``, what every copy holds counted), the copies with a slot on a
machine to drain, the machines to drain, and which machines hold each model's files. Out comes, for
every such copy, a ``Move`` (the machine or machines it goes to, with its GPUs and port) or a ``Stop``
with the reason in the product's words. ``deployments/drain_input.py`` reads the rows; the drain job
follows the plan the person agreed to.

The rules:

- A copy moves only to machines of the cluster that hold its model's files, are up, take new copies
  (a machine draining or leaving, one of this plan's included, takes none), and have its kind of GPU
  on its architecture with the share and the GPU memory it needs free: placement's rules, on the
  machines that hold the files.
- A copy that spans machines moves whole (placement's spanning rules) as soon as one of its slots is
  on a machine to drain, or stops. Its slots on the other machines stay held while it moves: the
  replacement starts before the copy stops, so the plan does not count on them.
- The moves are placed one after another, each on what the ones before it left: no GPU is promised
  twice. The copies go in the order (model, deployment, copy), so the same input gives the same plan
  whatever the order it comes in.
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction

from deployments.placement import PORT_RANGE, CopyWanted, GpuKind, MachineRoom
from deployments.placement_reasons import names_of
from deployments.placement_state import PlanState

__all__ = ["CopyOnMachine", "DrainPlan", "Move", "Stop", "Target", "button_label", "move_words", "plan_drain", "stop_words"]

NO_FILES = "no other machine holds {name}'s files"
FILES_DOWN = "no other machine that holds {name}'s files is up ({names} {verb} down)"
FILES_DRAINING = "no other machine that holds {name}'s files takes copies ({names} {verb} draining or leaving)"
FILES_OTHER_KIND = "no other machine that holds {name}'s files has {label} on {arch}"
MEMORY = "not enough GPU memory free on {name}: {free_gib} of the {need_gib} the copy needs"


@dataclass(frozen=True)
class CopyOnMachine:
    """A copy with a slot on a machine to drain, as the plan needs it."""

    id: int  # the copy's row
    deployment: int
    name: str  # its deployment's name, as sentences say it: "llama-8b"
    model: int  # the stored model whose files it serves
    gpus: Fraction  # its size: 1/4, 1/2, 1, 2 … 16
    memory_per_gpu_bytes: int
    kind: GpuKind
    arch: str
    machines: tuple[int, ...]  # the machines of its slots, the first where its engine runs
    number: int = 1  # its number within the deployment, for the card


@dataclass(frozen=True, slots=True)
class Target:
    """One machine's part of a moving copy: where its replacement starts."""

    machine_id: int
    machine_name: str
    gpu_indices: tuple[int, ...]
    share: Fraction  # of each of those GPUs: 1/4, 1/2 or 1
    port: int


@dataclass(frozen=True, slots=True)
class Move:
    copy: int
    slots: tuple[Target, ...]  # one per machine; the replacement's engine starts on the first

    @property
    def to(self) -> int:
        return self.slots[0].machine_id

    @property
    def to_name(self) -> str:
        return self.slots[0].machine_name


@dataclass(frozen=True, slots=True)
class Stop:
    copy: int
    reason: str  # "no other machine holds llama-8b's files"


@dataclass
class DrainPlan:
    moves: list[Move]  # in the order placed
    stops: list[Stop]

    @property
    def copies(self) -> int:
        return len(self.moves) + len(self.stops)


def plan_drain(machines: Iterable[MachineRoom], copies: Iterable[CopyOnMachine], draining: Collection[int],
               files: Mapping[int, Collection[int]], *, port_range: tuple[int, int] = PORT_RANGE) -> DrainPlan:
    """The plan for draining the machines ``draining`` (ids) of the cluster whose machines are ``machines``:
    a move or a stop for each of ``copies`` with a slot on one of them (the others are not part of it).
    ``files``: model id -> the ids of the machines that hold its files."""
    draining = frozenset(draining)
    moving = sorted((c for c in copies if not draining.isdisjoint(c.machines)), key=lambda c: (c.model, c.deployment, c.number, c.id))
    # Only the machines holding a moving copy's files can take one: placement needs no other.
    holding = set(draining)
    for model in {c.model for c in moving}:
        holding.update(files.get(model, ()))
    rooms = [replace(m, accepts_new=False) if m.id in draining and m.accepts_new else m
             for m in machines if m.id in holding]
    by_id = {m.id: m for m in rooms}
    state = PlanState(rooms, port_range)
    moves, stops, refused = [], [], []  # refused: (what placement was asked, its want, its place in stops)
    checked: dict[tuple, object] = {}  # (model, kind, arch) -> the machines a copy may go to, or why none
    for copy in moving:
        found = checked.get((copy.model, copy.kind, copy.arch))
        if found is None:
            found = checked[(copy.model, copy.kind, copy.arch)] = _takers(copy, files.get(copy.model, ()), by_id, draining)
        if isinstance(found, str):
            stops.append(Stop(copy.id, found))
            continue
        wanted = CopyWanted(f"d{copy.deployment}-c{copy.id}", copy.deployment, copy.gpus, copy.memory_per_gpu_bytes,
                            copy.kind, copy.arch)
        want = state.want(wanted, only=found)
        if want[1] is None or not (want[1].rooms or want[1].draining):  # none of them has the kind on the arch
            stops.append(Stop(copy.id, FILES_OTHER_KIND.format(name=copy.name, label=copy.kind.label, arch=copy.arch)))
            continue
        slots = None if want[0] is None or want[0] in state.failed else state.place(copy.deployment, want)
        if slots is None:
            refused.append((wanted, want, len(stops)))
            stops.append(Stop(copy.id, ""))  # placement's reason, once the plan is made
        else:
            moves.append(Move(copy.id, tuple(Target(m, by_id[m].name, indices, share, port)
                                            for m, indices, share, port in slots)))
    if refused:
        reasons = state.reasons([(wanted, want) for wanted, want, _ in refused], memory_sentence=MEMORY)
        for (_, _, at), reason in zip(refused, reasons):
            stops[at] = Stop(stops[at].copy, reason)
    return DrainPlan(moves, stops)


def _takers(copy: CopyOnMachine, holders: Collection[int], by_id: Mapping[int, MachineRoom],
            draining: frozenset[int]) -> frozenset[int] | str:
    """The machines of the cluster a copy of the model may move to (those holding its files, up, and, for
    some of them at least, taking copies), or why there is none."""
    others = [m for m in holders if m not in draining and m in by_id]
    if not others:
        return NO_FILES.format(name=copy.name)
    up = frozenset(m for m in others if by_id[m].up)
    if not up:
        names, verb = names_of(_names(others, by_id))
        return FILES_DOWN.format(name=copy.name, names=names, verb=verb)
    if not any(by_id[m].accepts_new for m in up):
        names, verb = names_of(_names(up, by_id))
        return FILES_DRAINING.format(name=copy.name, names=names, verb=verb)
    # Those of another kind or arch are left out by placement (FILES_OTHER_KIND when none is left); those
    # draining already (not by this plan) go with them: placement's reasons say when one had room.
    return up


def _names(ids: Iterable[int], by_id: Mapping[int, MachineRoom]) -> list[str]:
    return [by_id[m].name for m in sorted(ids)]


# ------------------------------------------------------------------ the card's words

def move_words(move: Move) -> str:
    """``Moves to lab-c (GPUs 0,1 · port 8101)``; a copy that spans names each machine."""
    return "Moves to " + " and ".join(f"{t.machine_name} ({_gpu_words(t)} · port {t.port})" for t in move.slots)


def stop_words(stop: Stop) -> str:
    return f"Stops: {stop.reason}"


def button_label(plan: DrainPlan, *, remove: bool = False) -> str:
    """``Drain``, or ``Drain and stop 2`` when copies would stop (``Remove`` … for Remove from cluster)."""
    verb = "Remove" if remove else "Drain"
    return f"{verb} and stop {len(plan.stops)}" if plan.stops else verb


def _gpu_words(target: Target) -> str:
    indices = ",".join(str(i) for i in target.gpu_indices)
    words = f"GPU{'s' if len(target.gpu_indices) > 1 else ''} {indices}"
    if target.share < 1:
        words += {Fraction(1, 4): ", a quarter", Fraction(1, 2): ", a half"}.get(target.share, f", {target.share}")
    return words
