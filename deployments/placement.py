"""Where each copy of a model runs: the console's placement, the only allocator of GPUs.

Plain data in, plain data out (no Django, no I/O): the machines with their GPUs and what copies
already hold of them, and the copies wanted, in order. Out comes, for every copy, the GPUs and the
port it gets on each machine it runs on, or why it cannot run yet (``placement_reasons.py``). The
services turn rows into these dataclasses and start each copy with exactly what the plan gave it.

The rules:

- A copy runs on one kind of GPU (vendor, model and memory) and one CPU architecture, never two.
- A share (a quarter or a half of a GPU) stays on one GPU, which other shares may hold too: their
  quarters add up to at most the GPU, their memory to at most its memory. A share fills a GPU that
  shares already use before it opens a free one, so quarters do not take whole GPUs one by one.
- A whole-GPU copy (1, 2, 4, 8 … GPUs) takes free GPUs (nothing on them) of one machine. One that
  needs more than any machine of its kind has spans machines, in equal slots of the largest power of
  two one machine holds (16 = 2 machines x 8); the first slot's machine is where its engine starts.
- Each slot gets the lowest port of the range its machine has free.
- Spread: among the machines that fit, the one holding the fewest copies of the same deployment,
  then the one with the most free GPUs of the kind, then the lowest id. The machines' order in the
  input does not matter.
- Only machines that are up and take new copies (not draining) get any; what is reserved on them
  (shares, memory, ports) is honoured, and so is what earlier copies of the same plan took.

How it stays fast (``bench/placement.py``: 1,000 machines and 10,000 copies in one plan) is
``placement_state.py``: machines grouped by (kind, arch), their room in heaps. Why a copy is refused
is ``placement_reasons.py``.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import NamedTuple

from deployments.placement_reasons import GB
from deployments.placement_state import SHARE_OF, PlanState, free_quarters

__all__ = [
    "PORT_RANGE", "SHARE_OF", "SIZES", "CopyWanted", "Gpu", "GpuKind", "KindFree", "MachineRoom", "Placement", "Plan",
    "Slot", "Unplaced", "free_accelerators", "free_quarters", "kinds", "memory_per_gpu", "plan", "suggest_gpus",
]

PORT_RANGE = (8100, 8199)  # the default; the console passes its per-machine setting
SIZES = (Fraction(1, 4), Fraction(1, 2), *(Fraction(2**n) for n in range(6)))  # a quarter … 32 GPUs


# ------------------------------------------------------------------ inputs and outputs

@dataclass(frozen=True)
class GpuKind:
    """What makes GPUs interchangeable for a copy: vendor, model and memory."""

    vendor: str  # "nvidia", "amd"
    model: str  # as people say it: "H100", "A100", "Instinct MI300X"
    memory_bytes: int

    @property
    def label(self) -> str:
        """``H100 80GB``: the model and its memory in whole GB, as sentences name a kind."""
        size = f"{round(self.memory_bytes / GB)}GB"
        return self.model if self.memory_bytes <= 0 or self.model.endswith(size) else f"{self.model} {size}"


@dataclass(frozen=True)
class Gpu:
    index: int
    kind: GpuKind
    share_taken: Fraction | int = 0  # what copies hold of it, in quarters: 0, 1/4 … 1
    memory_taken_bytes: int = 0  # the GPU memory those copies were given


@dataclass(frozen=True)
class MachineRoom:
    """A machine as placement sees it: its GPUs, what is reserved on them, and the ports its copies hold."""

    id: int
    name: str
    arch: str
    up: bool = True
    accepts_new: bool = True  # False while it drains
    gpus: tuple[Gpu, ...] = ()
    ports_taken: frozenset[int] = frozenset()
    deployment_copies: Mapping[int, int] = field(default_factory=dict)  # deployment id -> its copies here


@dataclass(frozen=True)
class CopyWanted:
    key: str  # "d7-c3"
    deployment: int
    gpus: Fraction  # 1/4, 1/2, 1, 2, 4, 8, 16 …
    memory_per_gpu_bytes: int  # on each of its GPUs (memory_per_gpu)
    kind: GpuKind
    arch: str


@dataclass(frozen=True, slots=True)
class Slot:
    """One machine's part of a copy."""

    machine_id: int
    gpu_indices: tuple[int, ...]
    share: Fraction  # of each of those GPUs: 1/4, 1/2 or 1
    port: int


@dataclass(frozen=True, slots=True)
class Placement:
    key: str
    slots: tuple[Slot, ...]  # one per machine; the engine starts on the first

    @property
    def machine_id(self) -> int:
        return self.slots[0].machine_id


@dataclass(frozen=True, slots=True)
class Unplaced:
    key: str
    reason: str  # "no machine has 2 free H100 80GB (the most free on one is 1, on lab-a)"


@dataclass
class Plan:
    placed: list[Placement]  # in the order wanted
    unplaced: list[Unplaced]


class KindFree(NamedTuple):
    """A choice for the Deploy form: one kind of GPU on one architecture."""

    kind: GpuKind
    arch: str
    machines: int  # up, with GPUs of the kind
    gpus: int  # of the kind, on those machines
    free: Fraction  # of those GPUs, on machines that take new copies, less what copies hold


# ------------------------------------------------------------------ helpers for the Deploy form

def free_accelerators(machines: Iterable[MachineRoom]) -> Fraction:
    """The GPUs of the machines that are up, less what copies hold of them."""
    return Fraction(sum(free_quarters(gpu) for machine in machines if machine.up for gpu in machine.gpus), 4)


def kinds(machines: Iterable[MachineRoom]) -> list[KindFree]:
    """Every kind of GPU and architecture among the machines that are up, the most free first."""
    totals: dict[tuple[GpuKind, str], list] = {}
    for machine in machines:
        if not machine.up:
            continue
        for gpu in machine.gpus:
            total = totals.setdefault((gpu.kind, machine.arch), [set(), 0, 0])
            total[0].add(machine.id)
            total[1] += 1
            total[2] += free_quarters(gpu) if machine.accepts_new else 0
    found = [KindFree(kind, arch, len(ids), count, Fraction(quarters, 4))
             for (kind, arch), (ids, count, quarters) in totals.items()]
    return sorted(found, key=lambda k: (-k.free, -k.gpus, k.kind.label, k.kind.vendor, k.arch))


def suggest_gpus(need_bytes: int, kind: GpuKind) -> Fraction | None:
    """The fewest GPUs of the kind (a quarter, a half, 1, 2 … 32) whose memory holds ``need_bytes``
    (weights plus the KV cache's share); for a share, its part of the GPU's memory must hold it."""
    return next((size for size in SIZES if size * kind.memory_bytes >= need_bytes), None)


def memory_per_gpu(need_bytes: int, gpus: Fraction) -> int:
    """What a copy of ``gpus`` needs on each GPU: all of it on a share's one GPU, else an equal part on each."""
    return need_bytes if gpus < 1 else -(-need_bytes // int(gpus))


# ------------------------------------------------------------------ the plan

def plan(machines: Iterable[MachineRoom], wanted: Iterable[CopyWanted], *,
         port_range: tuple[int, int] = PORT_RANGE) -> Plan:
    """Place the copies in the order given, each on what is left after the ones before it."""
    state = PlanState(machines, port_range)
    placed, refused, failed, wants = [], [], state.failed, {}
    for copy in wanted:
        # A deployment's copies want the same: it is worked out once, found by the objects' identity
        # (cheaper than hashing them; the dict holds them, so no other object takes their id meanwhile).
        kind, gpus = copy.kind, copy.gpus
        key = (id(kind), id(gpus), copy.arch, copy.memory_per_gpu_bytes)
        found = wants.get(key)
        if found is None:
            found = wants[key] = (kind, gpus, state.want(copy))
        want = found[2]
        slots = None if want[0] is None or want[0] in failed else state.place(copy.deployment, want)
        if slots is None:
            refused.append((copy, want))
        else:
            placed.append(Placement(copy.key, tuple([Slot(m, indices, share, port) for m, indices, share, port in slots])))
    reasons = state.reasons(refused) if refused else []
    return Plan(placed, [Unplaced(copy.key, reason) for (copy, _), reason in zip(refused, reasons)])
