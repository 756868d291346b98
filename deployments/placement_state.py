"""What is free while a plan is made, kept so that each copy costs a few heap operations
(``deployments/placement.py`` is the planner's face; ``bench/placement.py`` its clock).

Machines are grouped by (kind of GPU, arch). A group keeps its machines in a heap by free GPUs and
its shared GPUs in heaps by quarters free, each by memory free; an entry is (-room, machine id, GPU
index, version, item), so the top is the most room, then the lowest id. A copy pops from the top:
an entry whose item changed since it was pushed is dropped (its newer entry is in the heap), and the
machines that already hold the copy's deployment are set aside, and stay aside while that
deployment's next copies are placed, so a deployment of n copies pops each machine once rather than
n times. Room only shrinks during a plan, so a want (group, size, memory) that failed fails again at
once, and the reasons are worked out after the last copy, once per want (``placement_reasons.py``).

A copy may be held to some machines (``want(copy, only=...)``: the drain plan's machines that hold the
copy's model files): it is placed from a group of its own over those machines' rooms (the same
objects, so what it takes is taken for everyone), built once for each ``only`` given in a row. The
whole group's heaps are built again before a copy without ``only`` uses them.

Takes placement's dataclasses by their attributes and gives back plain tuples, so that it does not
import placement.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from heapq import heapify, heappop, heappush
from operator import attrgetter, itemgetter

from deployments.placement_reasons import BAD_MEMORY, BAD_SIZE, MEMORY, Kind, Offer, Reasons

SHARE_OF = {1: Fraction(1, 4), 2: Fraction(1, 2), 4: Fraction(1)}  # quarters -> a slot's share of each GPU


def free_quarters(gpu) -> int:
    """The quarters of the GPU no copy holds (a share that is not a whole quarter takes the quarter it starts)."""
    share = gpu.share_taken
    if not share:
        return 4
    if isinstance(share, float):
        share = Fraction(share)
    # ceil(4 * share) from its numerator and denominator: cheaper than the Fraction arithmetic (a fleet's worth of GPUs)
    return min(4, max(0, 4 + (-4 * share.numerator // share.denominator)))


def _quarters(gpus) -> int | None:
    """A copy's size in quarters of a GPU (1, 2, 4, 8 …), or None for a size a copy cannot take."""
    if isinstance(gpus, float):
        gpus = Fraction(gpus)
    try:
        numerator, denominator = gpus.numerator, gpus.denominator
    except AttributeError:
        return None
    if denominator == 1:
        quarters = 4 * numerator
    elif numerator == 1 and denominator in (2, 4):
        quarters = 4 // denominator
    else:
        return None
    return quarters if quarters > 0 and not quarters & (quarters - 1) else None


class _Machine:
    """A machine during a plan: its name and its next port."""

    __slots__ = ("id", "name", "port", "last", "taken")

    def __init__(self, room, port_range: tuple[int, int]):
        self.id, self.name, self.taken = room.id, room.name, room.ports_taken
        self.port, self.last = port_range

    def free_port(self) -> int | None:
        port, taken = self.port, self.taken
        while port in taken:
            port += 1
        self.port = port
        return port if port <= self.last else None


class _Room:
    """One machine's GPUs of one kind during a plan: the free ones (highest index first), the shared ones,
    and how many are full (nothing more goes on them: counted, not kept)."""

    __slots__ = ("machine", "free", "shared", "full", "version")

    def __init__(self, machine: _Machine):
        self.machine, self.free, self.shared, self.full, self.version = machine, [], [], 0, 0

    def entry(self) -> tuple:
        return (-len(self.free), self.machine.id, 0, self.version, self)


class _Shared:
    """A GPU shares hold part of: the quarters and the memory left on it."""

    __slots__ = ("machine", "index", "quarters", "memory", "version")

    def __init__(self, machine: _Machine, index: int, quarters: int, memory: int):
        self.machine, self.index, self.quarters, self.memory, self.version = machine, index, quarters, memory, 0

    def entry(self) -> tuple:
        return (-self.memory, self.machine.id, self.index, self.version, self)


class _Group:
    """The machines up with one kind of GPU and one arch. Heap entries: (-room, machine id, GPU index, version, item)."""

    __slots__ = ("kind", "arch", "rooms", "draining", "heap", "shared", "largest", "per_slot", "aside", "shared_aside",
                 "touched", "part", "stale")

    def __init__(self, kind, arch: str):
        self.kind, self.arch, self.rooms, self.draining = kind, arch, [], []
        self.heap, self.shared, self.largest, self.per_slot = [], [[] for _ in range(5)], 0, 1
        # The entries of machines holding the deployment being placed, out of ``heap`` and ``shared`` meanwhile
        self.aside, self.shared_aside, self.touched = [], [[] for _ in range(5)], False
        # part: a group over some of another's machines (``only``); stale: a part took room, so the heaps are built again
        self.part, self.stale = False, False

    def add(self, room: _Room, taking: bool) -> None:
        self.largest = max(self.largest, len(room.free) + len(room.shared) + room.full)
        if not taking:
            self.draining.append(room)
            return
        self.rooms.append(room)
        if room.free:
            self.heap.append(room.entry())
        for shared in room.shared:
            if shared.quarters:
                self.shared[shared.quarters].append(shared.entry())

    def heaps_again(self) -> None:
        """The heaps from the rooms as they are now (a part of the group took from them meanwhile)."""
        self.heap, self.shared = [], [[] for _ in range(5)]
        self.aside, self.shared_aside = [], [[] for _ in range(5)]
        for room in self.rooms:
            if room.free:
                self.heap.append(room.entry())
            for shared in room.shared:
                if shared.quarters:
                    self.shared[shared.quarters].append(shared.entry())
        for heap in (self.heap, *self.shared):
            heapify(heap)
        self.stale = False


def _top(heap: list, need: int, holders: Mapping[int, int], aside: list):
    """Pop the best entry with at least ``need`` on a machine with a port free that holds no copy of
    the deployment; those of machines that hold one are popped into ``aside``. None if there is none."""
    while heap:
        entry = heap[0]
        item = entry[4]
        if entry[3] != item.version:
            heappop(heap)  # the item changed since: its newer entry is in the heap, or it is full
            continue
        if -entry[0] < need:
            return None  # the top has the most: nothing below it has enough
        heappop(heap)
        if item.machine.free_port() is None:
            continue  # it keeps what it holds and takes nothing new: out of the heap for good
        if entry[1] in holders:
            aside.append(entry)
            continue
        return entry
    return None


def _restore(heap: list, aside: list) -> None:
    for entry in aside:
        if entry[3] == entry[4].version:  # a newer entry of a changed item is in the list too
            heappush(heap, entry)
    aside.clear()


class PlanState:
    """What is free while a plan is made: built from the machines, then taken from copy by copy."""

    def __init__(self, machines: Iterable, port_range: tuple[int, int]):
        if port_range[0] > port_range[1]:
            raise ValueError(f"The port range {port_range[0]}–{port_range[1]} is empty.")
        self.port_range, self.groups, self.canon, self.kinds = port_range, {}, {}, {}
        self.kept, self.down, self.failed, self.holders, self.any_up = [], {}, set(), {}, False
        self.touched, self.aside_for = [], None  # the groups with entries set aside, and for which deployment
        self.only, self.parts, self.rooms_of = None, {}, {}  # want(only=...): the last only, its parts; rooms by machine
        machines = sorted(machines, key=attrgetter("id"))
        for before, machine in zip(machines, machines[1:]):
            if before.id == machine.id:
                raise ValueError(f"Two machines have the id {machine.id}: {before.name} and {machine.name}.")
        for machine in machines:
            if machine.up:
                self.any_up = True
                self._add(machine)
            else:
                for gpu in machine.gpus:
                    names = self.down.setdefault((gpu.kind, machine.arch), [])
                    if machine.name not in names:
                        names.append(machine.name)
        for group in self.groups.values():
            group.per_slot = 1 << (group.largest.bit_length() - 1)
            for heap in (group.heap, *group.shared):
                heapify(heap)

    def _kind(self, kind):
        """One object per kind, found by identity first: hashing a dataclass for every GPU and copy costs more."""
        same = self.canon.get(id(kind))
        if same is None:
            self.kept.append(kind)  # so that its id is not reused during the plan
            same = self.canon[id(kind)] = self.kinds.setdefault(kind, kind)
        return same

    def _add(self, machine) -> None:
        state = _Machine(machine, self.port_range)
        rooms: dict[int, tuple[object, _Room]] = {}  # id(kind) -> (kind, room)
        given = room = None
        for gpu in machine.gpus:
            if gpu.kind is not given:  # a machine's GPUs are mostly of one kind
                given, kind = gpu.kind, self._kind(gpu.kind)
                found = rooms.get(id(kind))
                room = found[1] if found else rooms.setdefault(id(kind), (kind, _Room(state)))[1]
            if not gpu.memory_taken_bytes and not gpu.share_taken:  # the int first: a Fraction's truth costs a call
                room.free.append(gpu.index)
            elif quarters := free_quarters(gpu):  # shares, or memory something holds: only shares may still go on it
                room.shared.append(_Shared(state, gpu.index, quarters, max(0, kind.memory_bytes - gpu.memory_taken_bytes)))
            else:
                room.full += 1
        for kind, room in rooms.values():
            room.free.sort(reverse=True)
            group = self.groups.get((id(kind), machine.arch))
            if group is None:
                group = self.groups[(id(kind), machine.arch)] = _Group(kind, machine.arch)
            group.add(room, machine.accepts_new)
        for deployment, count in machine.deployment_copies.items():
            if count > 0:
                self.holders.setdefault(deployment, {})[machine.id] = count

    def want(self, copy, only=None) -> tuple:
        """(what fails for good once it fails, or None if nothing can take it; its group; its size in
        quarters; its slots and the GPUs of each (0 for a share); its memory on each GPU).

        ``only``: the ids of the machines the copy may go to (a set; pass the same object for copies that
        share it, one after another), or None for any."""
        quarters = _quarters(copy.gpus)
        group = self.groups.get((id(self._kind(copy.kind)), copy.arch))
        if group is not None:
            if only is not None:
                group = self._part(group, only)
            elif group.stale:
                group.heaps_again()
        memory, count, per = copy.memory_per_gpu_bytes, 1, 0
        if quarters is not None and quarters >= 4:
            per = quarters >> 2
            if group is not None and per > group.largest:
                count, per = per // group.per_slot, group.per_slot
        fits = group is not None and quarters is not None and 0 <= memory <= group.kind.memory_bytes
        return (group, quarters, memory) if fits else None, group, quarters, count, per, memory

    def _part(self, group: _Group, only) -> _Group:
        """The group over the machines of ``group`` in ``only``: the same rooms, heaps of its own."""
        if only is not self.only:
            self.only, self.parts = only, {}  # parts of an earlier only may be out of date: built anew when asked
        part = self.parts.get(id(group))
        if part is not None:
            return part
        rooms = self.rooms_of.get(id(group))
        if rooms is None:
            rooms = self.rooms_of[id(group)] = {room.machine.id: (room, True) for room in group.rooms}
            rooms.update((room.machine.id, (room, False)) for room in group.draining)
        part = self.parts[id(group)] = _Group(group.kind, group.arch)
        part.largest, part.per_slot, part.part = group.largest, group.per_slot, True  # a copy spans as in the whole group
        heap, shared = part.heap, part.shared
        for machine_id in only:
            found = rooms.get(machine_id)
            if found is None:
                continue
            room, taking = found
            if not taking:
                part.draining.append(room)
                continue
            part.rooms.append(room)
            if room.free:
                heap.append(room.entry())
            for item in room.shared:
                if item.quarters:
                    shared[item.quarters].append(item.entry())
        for heap in (heap, *shared):
            heapify(heap)
        group.stale = True
        return part

    def place(self, deployment: int, want: tuple) -> list[tuple] | None:
        """A copy of ``deployment`` that wants ``want``: its slots (machine id, GPU indices, share of
        each, port), the first where its engine starts, taken from what is free; None if it does not fit."""
        _, group, quarters, count, per, memory = want
        if deployment != self.aside_for:
            self._next_deployment(deployment)
        if not group.touched:
            group.touched = True
            self.touched.append(group)
        holders = self.holders.get(deployment)
        if holders is None:
            holders = self.holders[deployment] = {}
        picked = self._share(group, quarters, memory, holders) if per == 0 else self._whole(group, count, per, holders)
        if picked is None:
            self.failed.add(want[0])  # room only shrinks: the same want fails again
            return None
        slots = []
        for machine, indices, share in picked:
            holders[machine.id] = holders.get(machine.id, 0) + 1
            port = machine.free_port()
            machine.port = port + 1
            slots.append((machine.id, indices, share, port))
        return slots

    def _next_deployment(self, deployment: int) -> None:
        """The entries set aside for the deployment before go back into their heaps. A deployment's
        copies come one after another: its machines stay aside for all of them, popped once."""
        for group in self.touched:
            if group.aside:
                _restore(group.heap, group.aside)
            for left in (1, 2, 3, 4):
                if group.shared_aside[left]:
                    _restore(group.shared[left], group.shared_aside[left])
            group.touched = False
        self.touched.clear()
        self.aside_for = deployment

    def _whole(self, group: _Group, count: int, per: int, holders: dict) -> list | None:
        heap, aside, chosen = group.heap, group.aside, []
        while len(chosen) < count and (entry := _top(heap, per, holders, aside)):
            chosen.append(entry)
        if len(chosen) < count:
            # Every machine with room left holds the deployment already: the fewest copies of it first.
            fits = sorted((e for e in aside if e[3] == e[4].version and -e[0] >= per and e[4].machine.free_port() is not None),
                          key=lambda e: (holders[e[1]], e[:4]))
            if len(chosen) + len(fits) < count:
                for entry in chosen:
                    heappush(heap, entry)
                return None
            chosen += fits[:count - len(chosen)]  # their entries in aside go stale below
        picked = []
        for entry in chosen:
            room = entry[4]
            free = room.free
            picked.append((room.machine, tuple(free[:-per - 1:-1]), SHARE_OF[4]))
            del free[-per:]
            room.version += 1
            if free:
                aside.append(room.entry())  # it holds the deployment now
        return picked

    def _share(self, group: _Group, quarters: int, memory: int, holders: dict) -> list | None:
        found = None
        for left in range(quarters, 5):  # the GPU with the fewest quarters left that fit, so whole ones stay whole
            heap = group.shared[left]
            # The top holds the most memory of any entry, stale ones included (memory only shrinks).
            if heap and -heap[0][0] >= memory and (found := _top(heap, memory, holders, group.shared_aside[left])):
                break
        if not found and group.heap and -group.heap[0][0] >= 1:
            found = _top(group.heap, 1, holders, group.aside)
        if not found and not (found := self._fewest(group, quarters, memory, holders)):
            return None
        item = found[4]
        if type(item) is _Room:  # open a free GPU
            index = item.free.pop()
            item.version += 1
            if item.free:
                group.aside.append(item.entry())
            item.shared.append(_Shared(item.machine, index, 4, group.kind.memory_bytes))
            item = item.shared[-1]
        item.quarters -= quarters
        item.memory -= memory
        item.version += 1
        if item.quarters:
            group.shared_aside[item.quarters].append(item.entry())
        return [(item.machine, (item.index,), SHARE_OF[quarters])]

    def _fewest(self, group: _Group, quarters: int, memory: int, holders: dict) -> tuple | None:
        """When every machine with room holds the deployment: the fewest copies of it, a shared GPU first."""
        options = []
        for left in range(quarters, 5):
            for entry in group.shared_aside[left]:
                item = entry[4]
                if entry[3] == item.version and item.memory >= memory and item.machine.free_port() is not None:
                    options.append(((holders[entry[1]], 0, left) + entry[:4], entry))
        for entry in group.aside:
            if entry[3] == entry[4].version and entry[0] < 0 and entry[4].machine.free_port() is not None:
                options.append(((holders[entry[1]], 1, 0) + entry[:4], entry))
        return min(options, key=itemgetter(0))[1] if options else None

    def reasons(self, refused: Sequence[tuple], memory_sentence: str = MEMORY) -> list[str]:
        """Why each refused copy was refused, from what is free once the plan is made. A copy held to some
        machines (``want(only=...)``) is told about those machines alone."""
        summary = {}
        for group in self.groups.values():
            summary[(group.kind, group.arch)] = _summary(group)
        sentences = Reasons(summary, self.down, self.port_range, self.any_up, memory_sentence=memory_sentence)
        each, said, of_part = [], {}, {}  # id(want) -> its reason: consecutive copies of a deployment share one want
        for copy, want in refused:
            reason = said.get(id(want))
            if reason is None:
                _, group, quarters, count, per, memory = want
                told = sentences
                if group is not None and group.part:
                    told = of_part.get(id(group))
                    if told is None:
                        told = of_part[id(group)] = Reasons({(group.kind, group.arch): _summary(group)}, {},
                                                            self.port_range, True, memory_sentence=memory_sentence)
                if quarters is None:
                    reason = BAD_SIZE.format(gpus=copy.gpus)
                elif memory < 0:
                    reason = BAD_MEMORY.format(memory=memory)
                else:
                    reason = told.why(copy.kind, copy.arch, quarters, memory, count, per)
                said[id(want)] = reason
            each.append(reason)
        return each


def _summary(group: _Group) -> Kind:
    """What the group's machines have free now, for the reasons."""
    usable, portless, draining = Offer(), Offer(), Offer()
    for room in sorted(group.rooms, key=_by_machine) if group.part else group.rooms:
        _offer_add(usable if room.machine.free_port() is not None else portless, room, group.kind)
    for room in sorted(group.draining, key=_by_machine) if group.part else group.draining:
        _offer_add(draining, room, group.kind)
    return Kind(usable.finish(), portless.finish(), draining.finish())


def _by_machine(room: _Room) -> int:
    return room.machine.id


def _offer_add(offer: Offer, room: _Room, kind) -> None:
    shares = [(s.quarters, s.memory, s.index) for s in room.shared if s.quarters]
    if room.free:  # one free GPU stands for all: each is as good as another
        shares.append((4, kind.memory_bytes, room.free[-1]))
    offer.add(room.machine.name, len(room.free), shares)
