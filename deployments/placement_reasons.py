"""Why a copy cannot be placed, in a person's words: the sentences of ``deployments/placement.py``.

Placement only takes room, never gives it back, so a copy refused part way through a plan would be
refused at its end too. The planner therefore explains its refusals once, after the last copy: it
sums up, per kind of GPU and CPU architecture, what the machines have free then (an ``Offer`` for
the machines that take copies, one for those with no port left, one for those draining), and
``Reasons.why`` picks the sentence that helps most, naming the best candidate's shortfall. Copies
that want the same thing get the same sentence, worked out once.

Pure: no Django, no I/O. A kind is anything with a ``label`` and a ``memory_bytes`` (placement's
``GpuKind``; taken by its attributes so that this module does not import placement).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

GB = 1 << 30
SHARE_WORDS = {1: "a quarter", 2: "a half", 3: "three quarters", 4: "a whole GPU"}

BAD_SIZE = "a copy takes a quarter, a half or a power of two of GPUs (1, 2, 4, 8 …), not {gpus}"
BAD_MEMORY = "a copy's GPU memory cannot be below zero ({memory} bytes)"
NO_MACHINE_UP = "no machine is up"
KIND_DOWN = "no machine with {label} on {arch} is up ({names} {verb} down)"
OTHER_ARCH = "{name} is another architecture ({arch}) than the copy's ({copy_arch})"
OTHER_KIND = "{name}'s {label} are another kind than the copy's {copy_label}"
NO_GPU_UP = "no machine that is up has a GPU"
NO_KIND = "no machine has {label}"
DRAINING = "{names} {verb} draining"
DRAINING_HAS_ROOM = "; {name} has room, but it is draining"
NO_PORT = "no port free in {first}–{last} on {name}"
TOO_BIG = "the copy needs {need} on each GPU, more than a {label} has ({total})"
MEMORY = "not enough GPU memory free: {name}'s GPU {index} has {free} of {total} free, the copy needs {need}"
NO_SHARE = "no {label} has {share} free{most}"
NO_WHOLE = "no machine has {count} free {label}{most}"
NO_SPAN = "the copy spans {slots} machines with {per} free {label} each, and {have}"


def gigabytes(size: int) -> str:
    """``12.0 GB``: GPU memory as nvidia-smi counts it (GiB, written GB)."""
    return f"{size / GB:.1f} GB"


def gibibytes(size: int) -> str:
    """``30 GiB``, ``37.5 GiB``: GPU memory as the drain plan's sentences say it."""
    return f"{size / GB:.0f} GiB" if size % GB == 0 or size >= 100 * GB else f"{size / GB:.1f} GiB"


def names_of(names: list[str]) -> tuple[str, str]:
    """``lab-a`` / ``lab-a and lab-b`` / ``lab-a, lab-b and 3 more``, with the verb that agrees."""
    if len(names) == 1:
        return names[0], "is"
    if len(names) == 2:
        return f"{names[0]} and {names[1]}", "are"
    return f"{names[0]}, {names[1]} and {len(names) - 2} more", "are"


@dataclass
class Offer:
    """What some machines of one kind and architecture have free: machine by machine, the free GPUs
    of that kind, and the GPUs a share may still go on. Fill with ``add``, then ``finish``."""

    names: list[str] = field(default_factory=list)  # by machine id
    most_free: int = 0
    most_free_on: str = ""
    free_sorted: list[int] = field(default_factory=list)  # each machine's free GPUs, ascending
    first_with: dict[int, str] = field(default_factory=dict)  # free GPUs -> the first machine with at least that many
    # quarters -> (memory free, machine, GPU index): the GPU with the most memory free among those with
    # at least that many quarters free (a free GPU counts as 4 quarters and its whole memory)
    best_share: dict[int, tuple[int, str, int]] = field(default_factory=dict)

    def add(self, name: str, free_gpus: int, shares) -> None:
        """One machine (in id order): its free GPUs, and (quarters free, memory free, index) of each GPU
        that takes a share."""
        self.names.append(name)
        self.free_sorted.append(free_gpus)
        if free_gpus > self.most_free:  # the first machine with at least each count up to its own
            for count in range(self.most_free + 1, free_gpus + 1):
                self.first_with[count] = name
            self.most_free, self.most_free_on = free_gpus, name
        best = self.best_share
        for quarters, memory, index in shares:
            if (found := best.get(quarters)) is None or memory > found[0]:
                best[quarters] = (memory, name, index)

    def finish(self) -> Offer:
        self.free_sorted.sort()
        # best_share held the best GPU with exactly so many quarters free; from here on, with at least so many
        for quarters in (3, 2, 1):
            above = self.best_share.get(quarters + 1)
            here = self.best_share.get(quarters)
            if above and (here is None or above[0] > here[0]):
                self.best_share[quarters] = above
        return self

    def machines_with(self, gpus: int) -> int:
        return len(self.free_sorted) - bisect.bisect_left(self.free_sorted, gpus)

    def taker(self, quarters: int, memory: int, slots: int, per: int) -> str | None:
        """The machine that would take the copy (the first, for one that spans), or None."""
        if quarters < 4:
            best = self.best_share.get(quarters)
            return best[1] if best and best[0] >= memory else None
        if self.machines_with(per) >= slots:
            return self.first_with[per]
        return None

    @property
    def anything_free(self) -> bool:
        return bool(self.best_share)


@dataclass
class Kind:
    """The machines that are up with one kind of GPU and one architecture, by what they may take."""

    usable: Offer  # up, taking new copies, with a port left
    portless: Offer  # taking new copies, but no port left in the range
    draining: Offer


@dataclass
class Reasons:
    """The sentences for one plan's refusals, each worked out once per thing wanted."""

    kinds: dict  # (kind, arch) -> Kind
    down: dict  # (kind, arch) -> names of the machines that are down
    port_range: tuple[int, int]
    any_up: bool
    # The sentence when a GPU has the share free but not the memory: its name, index, free, total and need
    # (as gigabytes gives them), free_gib and need_gib (as gibibytes gives them).
    memory_sentence: str = MEMORY
    said: dict = field(default_factory=dict)

    def why(self, kind, arch: str, quarters: int, memory: int, slots: int, per: int) -> str:
        wanted = (kind, arch, quarters, memory, slots, per)
        if wanted not in self.said:
            self.said[wanted] = self._why(kind, arch, quarters, memory, slots, per)
        return self.said[wanted]

    def _why(self, kind, arch, quarters, memory, slots, per) -> str:
        if not self.any_up:
            return NO_MACHINE_UP
        if memory > kind.memory_bytes:
            return TOO_BIG.format(need=gigabytes(memory), label=kind.label, total=gigabytes(kind.memory_bytes))
        here = self.kinds.get((kind, arch))
        if here is None:
            if self.down.get((kind, arch)):
                names, verb = names_of(self.down[(kind, arch)])
                return KIND_DOWN.format(label=kind.label, arch=arch, names=names, verb=verb)
            return self._elsewhere(kind, arch, any_room=False)
        if name := here.portless.taker(quarters, memory, slots, per):
            return NO_PORT.format(first=self.port_range[0], last=self.port_range[1], name=name)
        usable = here.usable
        if not usable.names and not here.portless.names:
            names, verb = names_of(here.draining.names)  # every machine of the kind and arch drains
            return DRAINING.format(names=names, verb=verb)
        if quarters < 4 and (best := usable.best_share.get(quarters)):
            free, name, index = best
            sentence = self.memory_sentence.format(
                name=name, index=index, free=gigabytes(free), total=gigabytes(kind.memory_bytes), need=gigabytes(memory),
                free_gib=gibibytes(free), need_gib=gibibytes(memory))
        elif usable.anything_free or not (sentence := self._elsewhere(kind, arch, any_room=True)):
            sentence = self._short(kind, usable, quarters, slots, per)
        if name := here.draining.taker(quarters, memory, slots, per):
            sentence += DRAINING_HAS_ROOM.format(name=name)
        return sentence

    def _elsewhere(self, kind, arch: str, any_room: bool) -> str:
        """When no machine of the copy's kind and arch has room: the machine of the same kind on another
        arch with the most free, else of another kind (on the copy's arch first). Empty when
        ``any_room`` and none has room."""
        def most_free(pairs):
            found = [(here.usable.most_free, here.usable.anything_free, pair) for pair, here in pairs
                     if here.usable.names and (here.usable.anything_free or not any_room)]
            return max(found, key=lambda f: (f[0], f[1], f[2][1] == arch), default=None)

        same_kind = most_free((pair, here) for pair, here in self.kinds.items() if pair[0] == kind and pair[1] != arch)
        if same_kind:
            usable = self.kinds[same_kind[2]].usable
            return OTHER_ARCH.format(name=usable.most_free_on or usable.names[0], arch=same_kind[2][1], copy_arch=arch)
        other_kind = most_free((pair, here) for pair, here in self.kinds.items() if pair[0] != kind)
        if other_kind:
            usable = self.kinds[other_kind[2]].usable
            return OTHER_KIND.format(name=usable.most_free_on or usable.names[0], label=other_kind[2][0].label,
                                     copy_label=kind.label)
        if any_room:
            return ""
        return NO_KIND.format(label=kind.label) if self.kinds else NO_GPU_UP

    def _short(self, kind, usable: Offer, quarters: int, slots: int, per: int) -> str:
        """The copy's kind and arch are there, with too little free: by how much."""
        if quarters < 4:
            room = max((q for q in usable.best_share if q < quarters), default=0)
            if room:
                _, name, index = usable.best_share[room]
                most = f" ({name}'s GPU {index} has {SHARE_WORDS[room]} free)"
            else:
                most = " (every one is taken)"
            return NO_SHARE.format(label=kind.label, share=SHARE_WORDS[quarters], most=most)
        if slots == 1:
            if per == 1:
                return f"no machine has a free {kind.label}"
            most = f" (the most free on one is {usable.most_free}, on {usable.most_free_on})" if usable.most_free \
                else " (none is free)"
            return NO_WHOLE.format(count=per, label=kind.label, most=most)
        have = usable.machines_with(per)
        words = f"only {have} {'has' if have == 1 else 'have'} them ({usable.first_with[per]})" if have \
            else "none has them"
        return NO_SPAN.format(slots=slots, per=per, label=kind.label, have=words)
