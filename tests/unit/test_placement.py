"""Placement of model copies on GPUs (deployments/placement.py): each rule and each reason by example,
then properties over generated fleets, against a planner that compares every candidate by brute force."""
import random
from collections import Counter
from fractions import Fraction as F

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.placement import (
    SHARE_OF,
    CopyWanted,
    Gpu,
    GpuKind,
    KindFree,
    MachineRoom,
    Placement,
    Slot,
    free_accelerators,
    free_quarters,
    kinds,
    memory_per_gpu,
    plan,
    suggest_gpus,
)

GB = 1 << 30
H100 = GpuKind("nvidia", "H100", 80 * GB)
A100 = GpuKind("nvidia", "A100", 40 * GB)
GH200 = GpuKind("nvidia", "GH200", 96 * GB)
MI300X = GpuKind("amd", "Instinct MI300X", 192 * GB)


def machine(id, name=None, gpus=8, kind=H100, arch="x86_64", taken=None, **extra):
    """``taken``: {GPU index: (share, GB of memory)} that copies hold already."""
    taken = taken or {}
    return MachineRoom(
        id=id, name=name or f"lab-{'abcdefghijklmnopqrstuvwxyz'[id - 1]}", arch=arch,
        gpus=tuple(Gpu(i, kind, F(taken[i][0]), int(taken[i][1] * GB)) if i in taken else Gpu(i, kind)
                   for i in range(gpus)),
        **extra,
    )


def copy(key="c1", gpus=1, memory_gb=60.0, kind=H100, arch="x86_64", deployment=1):
    return CopyWanted(key, deployment, F(gpus), int(memory_gb * GB), kind, arch)


def where(result):
    """key -> [(machine id, GPU indices, share, port), …] of the placed copies."""
    return {p.key: [(s.machine_id, s.gpu_indices, s.share, s.port) for s in p.slots] for p in result.placed}


def why(result):
    return {u.key: u.reason for u in result.unplaced}


# ------------------------------------------------------------------ the rules, by example

def test_a_whole_gpu_copy_takes_the_lowest_free_gpus_and_the_lowest_free_port():
    result = plan([machine(1, taken={0: (1, 70)}, ports_taken=frozenset({8100}))], [copy(gpus=2)])
    assert where(result) == {"c1": [(1, (1, 2), 1, 8101)]}


def test_a_copy_of_the_plan_takes_what_an_earlier_one_left_ports_included():
    result = plan([machine(1, gpus=4)], [copy("c1", gpus=2), copy("c2", gpus=2, deployment=2)])
    assert where(result) == {"c1": [(1, (0, 1), 1, 8100)], "c2": [(1, (2, 3), 1, 8101)]}


def test_a_share_fills_a_gpu_another_share_holds_before_it_opens_a_free_one():
    fleet = [machine(1, taken={3: (F(1, 2), 30)})]
    result = plan(fleet, [copy(gpus=F(1, 4), memory_gb=20)])
    assert where(result) == {"c1": [(1, (3,), F(1, 4), 8100)]}


def test_a_share_goes_on_the_gpu_with_the_fewest_quarters_left_that_hold_it():
    fleet = [machine(1, taken={1: (F(1, 4), 10), 2: (F(1, 2), 10)})]
    result = plan(fleet, [copy(gpus=F(1, 2), memory_gb=20)])
    assert where(result)["c1"][0][1] == (2,)


def test_shares_on_one_gpu_add_up_to_one_gpu_at_most():
    result = plan([machine(1, gpus=1)], [copy(f"c{n}", gpus=F(1, 4), memory_gb=10, deployment=n) for n in range(5)])
    assert [w[0][1] for w in where(result).values()] == [(0,)] * 4
    assert why(result) == {"c4": "no H100 80GB has a quarter free (every one is taken)"}


def test_shares_on_one_gpu_never_hold_more_than_its_memory():
    result = plan([machine(1, gpus=1)], [copy("c1", F(1, 4), 50, deployment=1), copy("c2", F(1, 4), 40, deployment=2)])
    assert list(where(result)) == ["c1"]
    assert why(result)["c2"] == ("not enough GPU memory free: lab-a's GPU 0 has 30.0 GB of 80.0 GB free, "
                                 "the copy needs 40.0 GB")


def test_a_gpu_whose_memory_something_holds_takes_shares_but_no_whole_copy():
    fleet = [machine(1, gpus=1, taken={0: (0, 8)})]
    assert where(plan(fleet, [copy(gpus=1, memory_gb=10)])) == {}
    assert where(plan(fleet, [copy(gpus=F(1, 2), memory_gb=10)])) == {"c1": [(1, (0,), F(1, 2), 8100)]}


def test_a_copy_needing_more_gpus_than_one_machine_has_spans_machines_in_equal_slots():
    fleet = [machine(n, gpus=8) for n in (1, 2, 3)]
    result = plan(fleet, [copy(gpus=16)])
    assert where(result) == {"c1": [(1, tuple(range(8)), 1, 8100), (2, tuple(range(8)), 1, 8100)]}


def test_a_spanning_copy_never_mixes_kinds_of_gpu():
    fleet = [machine(1, gpus=8), machine(2, gpus=8, kind=A100)]
    result = plan(fleet, [copy(gpus=16, memory_gb=30)])
    assert why(result) == {"c1": "the copy spans 2 machines with 8 free H100 80GB each, and only 1 has them (lab-a)"}


def test_a_spanning_copy_never_mixes_architectures():
    fleet = [machine(1, gpus=4, kind=GH200, arch="aarch64"), machine(2, gpus=4, kind=GH200, arch="x86_64")]
    result = plan(fleet, [copy(gpus=8, kind=GH200, arch="aarch64")])
    assert why(result)["c1"].startswith("the copy spans 2 machines with 4 free GH200 96GB each")


def test_a_copy_that_fits_one_machine_does_not_span_even_when_none_has_room_for_it():
    fleet = [machine(1, gpus=8, taken={0: (1, 70)}), machine(2, gpus=8, taken={0: (1, 70)})]
    assert why(plan(fleet, [copy(gpus=8)])) == {"c1": "no machine has 8 free H100 80GB (the most free on one is 7, on lab-a)"}


def test_copies_of_one_deployment_spread_over_machines_before_any_machine_gets_two():
    fleet = [machine(n, gpus=8) for n in (1, 2, 3)]
    result = plan(fleet, [copy(f"c{n}", gpus=1) for n in range(4)])
    assert [w[0][0] for w in where(result).values()] == [1, 2, 3, 1]


def test_copies_the_machines_hold_already_count_for_spreading():
    fleet = [machine(1, deployment_copies={1: 2}), machine(2, deployment_copies={1: 1}), machine(3)]
    result = plan(fleet, [copy(f"c{n}", gpus=1) for n in range(3)])
    assert [w[0][0] for w in where(result).values()] == [3, 2, 3]


def test_among_machines_holding_as_many_copies_the_one_with_the_most_free_gpus_wins_then_the_lowest_id():
    fleet = [machine(1, taken={0: (1, 70)}), machine(2), machine(3)]
    result = plan(fleet, [copy("c1", gpus=1, deployment=1), copy("c2", gpus=1, deployment=2)])
    assert [w[0][0] for w in where(result).values()] == [2, 3]


def test_a_share_of_a_deployment_goes_to_a_machine_without_one_before_sharing_a_gpu_with_it():
    fleet = [machine(1, gpus=1), machine(2, gpus=1)]
    result = plan(fleet, [copy(f"c{n}", gpus=F(1, 4), memory_gb=10) for n in range(3)])
    assert [w[0][:2] for w in where(result).values()] == [(1, (0,)), (2, (0,)), (1, (0,))]


def test_draining_and_down_machines_take_nothing_new():
    fleet = [machine(1, accepts_new=False), machine(2, up=False), machine(3, gpus=1)]
    result = plan(fleet, [copy("c1"), copy("c2", deployment=2)])
    assert where(result) == {"c1": [(3, (0,), 1, 8100)]}


def test_ports_come_from_the_range_given_and_skip_those_taken():
    fleet = [machine(1, ports_taken=frozenset({9000, 9002}))]
    result = plan(fleet, [copy(f"c{n}", deployment=n) for n in range(3)], port_range=(9000, 9010))
    assert [w[0][3] for w in where(result).values()] == [9001, 9003, 9004]


def test_the_machines_order_in_the_input_does_not_change_the_plan():
    fleet = [machine(n, gpus=2) for n in range(1, 6)]
    wanted = [copy(f"c{n}", gpus=[F(1, 4), 1, 2][n % 3], memory_gb=15, deployment=n % 2) for n in range(9)]
    assert plan(fleet, wanted) == plan(list(reversed(fleet)), wanted)


def test_two_machines_with_one_id_are_refused():
    with pytest.raises(ValueError, match="Two machines have the id 1"):
        plan([machine(1), machine(1, name="lab-z")], [])


# ------------------------------------------------------------------ why a copy is not placed

def test_no_machine_has_2_free_h100_names_the_most_free_on_one():
    fleet = [machine(1, gpus=2, taken={0: (1, 70)}), machine(2, gpus=2, taken={0: (1, 70), 1: (1, 70)})]
    assert why(plan(fleet, [copy(gpus=2)])) == {"c1": "no machine has 2 free H100 80GB (the most free on one is 1, on lab-a)"}


def test_no_machine_has_a_free_h100_when_every_one_is_taken():
    assert why(plan([machine(1, gpus=1, taken={0: (1, 70)})], [copy()])) == {"c1": "no machine has a free H100 80GB"}


def test_another_kind_is_named_when_the_only_free_gpus_are_of_another_kind():
    fleet = [machine(1, gpus=1, taken={0: (1, 70)}), machine(3, kind=A100, gpus=4)]
    assert why(plan(fleet, [copy()])) == {"c1": "lab-c's A100 40GB are another kind than the copy's H100 80GB"}


def test_another_kind_is_named_when_no_machine_has_the_copys_kind():
    assert why(plan([machine(3, kind=A100)], [copy()])) == {"c1": "lab-c's A100 40GB are another kind than the copy's H100 80GB"}


def test_another_architecture_is_named_when_the_kind_runs_only_on_it():
    fleet = [machine(2, kind=GH200, arch="aarch64", gpus=4)]
    result = plan(fleet, [copy(kind=GH200, arch="x86_64")])
    assert why(result) == {"c1": "lab-b is another architecture (aarch64) than the copy's (x86_64)"}


def test_not_enough_gpu_memory_free_names_the_gpu_with_the_most():
    fleet = [machine(1, gpus=2, taken={0: (F(1, 4), 68), 1: (F(1, 4), 60)})]
    result = plan(fleet, [copy(gpus=F(1, 4), memory_gb=25)])
    assert why(result) == {"c1": "not enough GPU memory free: lab-a's GPU 1 has 20.0 GB of 80.0 GB free, "
                                 "the copy needs 25.0 GB"}


def test_a_copy_needing_more_memory_than_the_kind_has_says_so():
    assert why(plan([machine(1)], [copy(memory_gb=90)])) == {
        "c1": "the copy needs 90.0 GB on each GPU, more than a H100 80GB has (80.0 GB)"}


def test_no_machine_is_up():
    assert why(plan([machine(1, up=False)], [copy()])) == {"c1": "no machine is up"}
    assert why(plan([], [copy()])) == {"c1": "no machine is up"}


def test_the_kinds_machines_being_down_is_named():
    fleet = [machine(1, up=False), machine(2, up=False), machine(3, kind=A100)]
    assert why(plan(fleet, [copy()])) == {"c1": "no machine with H100 80GB on x86_64 is up (lab-a and lab-b are down)"}


def test_a_draining_machine_is_named_when_every_machine_of_the_kind_drains():
    fleet = [machine(1, accepts_new=False), machine(3, kind=A100)]
    assert why(plan(fleet, [copy()])) == {"c1": "lab-a is draining"}


def test_a_draining_machine_with_room_is_named_after_the_shortfall():
    fleet = [machine(1, gpus=1, taken={0: (1, 70)}), machine(2, accepts_new=False)]
    assert why(plan(fleet, [copy()])) == {"c1": "no machine has a free H100 80GB; lab-b has room, but it is draining"}


def test_no_port_free_names_the_range_and_the_machine():
    fleet = [machine(1, ports_taken=frozenset(range(8100, 8200)))]
    assert why(plan(fleet, [copy()])) == {"c1": "no port free in 8100–8199 on lab-a"}


def test_no_port_left_after_earlier_copies_of_the_plan():
    result = plan([machine(1)], [copy("c1"), copy("c2", deployment=2)], port_range=(9000, 9000))
    assert why(result) == {"c2": "no port free in 9000–9000 on lab-a"}


def test_a_size_a_copy_cannot_take_is_named():
    assert why(plan([machine(1)], [copy(gpus=3), copy("c2", gpus=F(3, 4))])) == {
        "c1": "a copy takes a quarter, a half or a power of two of GPUs (1, 2, 4, 8 …), not 3",
        "c2": "a copy takes a quarter, a half or a power of two of GPUs (1, 2, 4, 8 …), not 3/4",
    }


def test_a_share_larger_than_any_gpu_has_free_names_the_most_free():
    fleet = [machine(1, gpus=1, taken={0: (F(3, 4), 20)})]
    assert why(plan(fleet, [copy(gpus=F(1, 2), memory_gb=10)])) == {
        "c1": "no H100 80GB has a half free (lab-a's GPU 0 has a quarter free)"}


def test_copies_that_want_the_same_thing_get_the_same_reason():
    result = plan([machine(1, gpus=1)], [copy(f"c{n}", deployment=n) for n in range(4)])
    assert len(result.placed) == 1
    assert set(why(result).values()) == {"no machine has a free H100 80GB"}


# ------------------------------------------------------------------ the Deploy form's helpers

def test_a_kinds_label_is_its_model_and_its_memory_in_whole_gb():
    assert H100.label == "H100 80GB"
    assert GpuKind("nvidia", "H100 80GB", 81559 << 20).label == "H100 80GB"
    assert GpuKind("nvidia", "GH200", 97871 << 20).label == "GH200 96GB"


def test_kinds_count_machines_gpus_and_free_gpus_the_most_free_first():
    fleet = [machine(1, gpus=8, taken={0: (1, 70), 1: (F(1, 4), 10)}), machine(2, gpus=4, kind=A100),
             machine(3, gpus=8, accepts_new=False), machine(4, gpus=4, kind=A100, up=False)]
    assert kinds(fleet) == [
        KindFree(H100, "x86_64", 2, 16, F(27, 4)),  # the draining machine's GPUs are not free for new copies
        KindFree(A100, "x86_64", 1, 4, F(4)),
    ]


def test_free_accelerators_are_the_gpus_of_machines_up_less_what_copies_hold():
    fleet = [machine(1, gpus=8, taken={0: (1, 70), 1: (F(1, 4), 10)}), machine(2, gpus=8, up=False)]
    assert free_accelerators(fleet) == F(27, 4)


@pytest.mark.parametrize(("need_gb", "kind", "gpus"), [
    (15, H100, F(1, 4)), (20, H100, F(1, 4)), (21, H100, F(1, 2)), (60, H100, 1), (81, H100, 2),
    (300, H100, 4), (600, H100, 8), (1300, H100, 32), (41, A100, 2), (2600, H100, None),
])
def test_suggest_gpus_gives_the_fewest_that_hold_the_model(need_gb, kind, gpus):
    assert suggest_gpus(need_gb * GB, kind) == gpus


def test_memory_per_gpu_is_all_of_it_on_a_share_and_an_equal_part_on_each_whole_gpu():
    assert memory_per_gpu(10 * GB, F(1, 4)) == 10 * GB
    assert memory_per_gpu(100 * GB + 1, F(4)) == 25 * GB + 1


# ------------------------------------------------------------------ a planner that compares every candidate

QUARTERS = {F(1, 4): 1, F(1, 2): 2, **{F(2 ** n): 4 * 2 ** n for n in range(8)}}


def reference_placements(machines, wanted, port_range):
    """The rules taken literally, with a scan of every GPU of every machine for every copy."""
    machines = sorted(machines, key=lambda m: m.id)
    gpus = {}  # (machine id, index) -> [kind, quarters free, memory free, free for a whole copy]
    ports = {m.id: set(m.ports_taken) for m in machines}
    held = {(d, m.id): c for m in machines for d, c in m.deployment_copies.items() if c > 0}
    largest = {}
    for m in machines:
        for g in m.gpus:
            gpus[(m.id, g.index)] = [g.kind, free_quarters(g), max(0, g.kind.memory_bytes - g.memory_taken_bytes),
                                     not g.share_taken and not g.memory_taken_bytes]
            if m.up:
                count = sum(h.kind == g.kind for h in m.gpus)
                largest[(g.kind, m.arch)] = max(largest.get((g.kind, m.arch), 0), count)

    def port_of(m):
        port = port_range[0]
        while port in ports[m.id]:
            port += 1
        return port if port <= port_range[1] else None

    def mine(m, kind):
        return sorted(i for (mid, i), g in gpus.items() if mid == m.id and g[0] == kind)

    placed = []
    for c in wanted:
        quarters, memory = QUARTERS.get(c.gpus), c.memory_per_gpu_bytes
        if quarters is None or (c.kind, c.arch) not in largest or not 0 <= memory <= c.kind.memory_bytes:
            continue
        usable = [m for m in machines if m.up and m.accepts_new and m.arch == c.arch and port_of(m) is not None]
        if quarters < 4:
            options = []
            for m in usable:
                copies = held.get((c.deployment, m.id), 0)
                indices = mine(m, c.kind)
                free = [i for i in indices if gpus[(m.id, i)][3]]
                for i in indices:
                    g = gpus[(m.id, i)]
                    if not g[3] and g[1] >= quarters and g[2] >= memory:
                        options.append(((copies, 0, g[1], -g[2], m.id, i), m, i))
                if free:
                    options.append(((copies, 1, 0, -len(free), m.id, 0), m, free[0]))
            if not options:
                continue
            _, m, i = min(options, key=lambda o: o[0])
            g = gpus[(m.id, i)]
            g[1], g[2], g[3] = g[1] - quarters, g[2] - memory, False
            chosen = [(m, (i,), SHARE_OF[quarters])]
        else:
            count, per = 1, quarters // 4
            if per > largest[(c.kind, c.arch)]:
                per = 1 << (largest[(c.kind, c.arch)].bit_length() - 1)
                count = quarters // 4 // per
            options = []
            for m in usable:
                free = [i for i in mine(m, c.kind) if gpus[(m.id, i)][3]]
                if len(free) >= per:
                    options.append(((held.get((c.deployment, m.id), 0), -len(free), m.id), m, free[:per]))
            if len(options) < count:
                continue
            chosen = []
            for _, m, indices in sorted(options, key=lambda o: o[0])[:count]:
                for i in indices:
                    gpus[(m.id, i)][1], gpus[(m.id, i)][3] = 0, False
                chosen.append((m, tuple(indices), SHARE_OF[4]))
        slots = []
        for m, indices, share in chosen:
            port = port_of(m)
            ports[m.id].add(port)
            held[(c.deployment, m.id)] = held.get((c.deployment, m.id), 0) + 1
            slots.append(Slot(m.id, indices, share, port))
        placed.append(Placement(c.key, tuple(slots)))
    return placed


# ------------------------------------------------------------------ properties over generated fleets

MANY = settings(max_examples=100, deadline=None)
KINDS = [H100, A100, MI300X]
ARCHES = ["x86_64", "aarch64"]
MOSTLY_H100, MOSTLY_X86 = [H100, H100, A100, MI300X], ["x86_64", "x86_64", "x86_64", "aarch64"]  # so that copies span
PORTS = (9000, 9005)  # a narrow range, so that machines run out of ports too
SIZES = [F(1, 4), F(1, 2), F(1), F(2), F(4), F(8), F(16)]


@st.composite
def gpus_taken(draw, kind, first, count):
    gpus = []
    for index in range(first, first + count):
        share = draw(st.sampled_from([0, 0, 0, F(1, 4), F(1, 2), F(3, 4), 1]))
        memory = 0
        if share:
            memory = draw(st.integers(0, int(kind.memory_bytes * share)))
        elif draw(st.integers(0, 9)) == 0:
            memory = draw(st.integers(1, kind.memory_bytes // 2))  # memory something holds without a share
        gpus.append(Gpu(index, kind, F(share), memory))
    return gpus


@st.composite
def fleets(draw):
    ids = draw(st.lists(st.integers(1, 60), min_size=1, max_size=9, unique=True))
    machines = []
    for id in ids:
        kind, count = draw(st.sampled_from(MOSTLY_H100)), draw(st.sampled_from([1, 2, 4, 8]))
        gpus = draw(gpus_taken(kind, 0, count)) if draw(st.booleans()) else [Gpu(i, kind) for i in range(count)]
        if draw(st.integers(0, 5)) == 0:  # a few GPUs of a second kind
            gpus += draw(gpus_taken(draw(st.sampled_from(KINDS)), count, draw(st.integers(1, 2))))
        machines.append(MachineRoom(
            id=id, name=f"gpu-{id}", arch=draw(st.sampled_from(MOSTLY_X86)),
            up=draw(st.integers(0, 7)) > 0, accepts_new=draw(st.integers(0, 7)) > 0, gpus=tuple(gpus),
            ports_taken=frozenset(draw(st.lists(st.integers(PORTS[0], PORTS[1] + 1), max_size=3))),
            deployment_copies=draw(st.dictionaries(st.integers(1, 3), st.integers(0, 2), max_size=2)),
        ))
    return machines


@st.composite
def cases(draw):
    """A fleet, and copies that mostly want a kind and an arch the fleet has."""
    machines = draw(fleets())
    offered = sorted({(g.kind.model, m.arch) for m in machines for g in m.gpus})
    wanted = []
    for n in range(draw(st.integers(0, 18))):
        if offered and draw(st.integers(0, 4)):
            model, arch = draw(st.sampled_from(offered))
            kind = next(k for k in KINDS if k.model == model)
        else:
            kind, arch = draw(st.sampled_from(KINDS)), draw(st.sampled_from(ARCHES))
        if draw(st.booleans()):
            kind = GpuKind(kind.vendor, kind.model, kind.memory_bytes)  # equal, not the same object
        gpus = draw(st.sampled_from(SIZES))
        memory = draw(st.integers(0, int(kind.memory_bytes * min(gpus, 1))))
        wanted.append(CopyWanted(f"c{n}", draw(st.integers(1, 3)), gpus, memory, kind, arch))
    return machines, wanted


@MANY
@given(case=cases())
def test_the_plan_is_the_one_comparing_every_candidate_gives(case):
    machines, wanted = case
    assert plan(machines, wanted, port_range=PORTS).placed == reference_placements(machines, wanted, PORTS)


@MANY
@given(case=cases())
def test_no_gpu_is_ever_given_more_than_its_quarters_or_its_memory(case):
    machines, wanted = case
    result = plan(machines, wanted, port_range=PORTS)
    by_key = {c.key: c for c in wanted}
    gpus = {(m.id, g.index): g for m in machines for g in m.gpus}
    share = {key: F(g.share_taken) for key, g in gpus.items()}
    memory = {key: g.memory_taken_bytes for key, g in gpus.items()}
    for placement in result.placed:
        for slot in placement.slots:
            for index in slot.gpu_indices:
                gpu = gpus[(slot.machine_id, index)]
                if slot.share == 1:  # a whole GPU: nothing on it before, nothing after
                    assert share[(slot.machine_id, index)] == 0 and memory[(slot.machine_id, index)] == 0
                share[(slot.machine_id, index)] += slot.share
                memory[(slot.machine_id, index)] += by_key[placement.key].memory_per_gpu_bytes
                assert share[(slot.machine_id, index)] <= 1
                assert memory[(slot.machine_id, index)] <= gpu.kind.memory_bytes


@MANY
@given(case=cases())
def test_a_copy_runs_on_its_own_kind_and_arch_on_machines_that_take_copies_in_equal_slots(case):
    machines, wanted = case
    result = plan(machines, wanted, port_range=PORTS)
    by_key, by_id = {c.key: c for c in wanted}, {m.id: m for m in machines}
    for placement in result.placed:
        wanted_copy = by_key[placement.key]
        slots = placement.slots
        assert len({s.machine_id for s in slots}) == len(slots)
        assert len({len(s.gpu_indices) for s in slots}) == 1
        assert sum(len(s.gpu_indices) * s.share for s in slots) == wanted_copy.gpus
        for slot in slots:
            host = by_id[slot.machine_id]
            assert host.up and host.accepts_new and host.arch == wanted_copy.arch
            kinds_used = {g.kind for g in host.gpus if g.index in slot.gpu_indices}
            assert kinds_used == {wanted_copy.kind}


@MANY
@given(case=cases())
def test_every_copy_is_placed_or_has_a_reason_in_the_order_wanted(case):
    machines, wanted = case
    result = plan(machines, wanted, port_range=PORTS)
    placed, unplaced = [p.key for p in result.placed], [u.key for u in result.unplaced]
    keys = [c.key for c in wanted]
    assert sorted(placed + unplaced) == sorted(keys)
    assert placed == [k for k in keys if k in set(placed)] and unplaced == [k for k in keys if k in set(unplaced)]
    assert all(u.reason and "{" not in u.reason for u in result.unplaced)


@MANY
@given(case=cases(), data=st.data())
def test_the_same_input_gives_the_same_plan_in_any_order_of_machines(case, data):
    machines, wanted = case
    result = plan(machines, wanted, port_range=PORTS)
    assert plan(data.draw(st.permutations(machines)), wanted, port_range=PORTS) == result
    assert plan(machines, wanted, port_range=PORTS) == result


@MANY
@given(case=cases())
def test_ports_are_in_the_range_and_never_given_twice_on_a_machine(case):
    machines, wanted = case
    result = plan(machines, wanted, port_range=PORTS)
    taken = {m.id: set(m.ports_taken) for m in machines}
    for placement in result.placed:
        for slot in placement.slots:
            assert PORTS[0] <= slot.port <= PORTS[1]
            assert slot.port not in taken[slot.machine_id]
            taken[slot.machine_id].add(slot.port)


@MANY
@given(machine_count=st.integers(1, 8), gpus=st.sampled_from([1, 2, 4, 8]), size=st.sampled_from(SIZES[:5]),
       copies=st.integers(1, 40))
def test_one_deployments_copies_on_identical_empty_machines_differ_by_one_at_most_per_machine(
        machine_count, gpus, size, copies):
    fleet = [machine(n, name=f"gpu-{n}", gpus=gpus) for n in range(1, machine_count + 1)]
    wanted = [copy(f"c{n}", gpus=size, memory_gb=10) for n in range(copies)]
    result = plan(fleet, wanted)
    per_machine = Counter(p.machine_id for p in result.placed if len(p.slots) == 1)
    counts = [per_machine.get(m.id, 0) for m in fleet]
    assert max(counts) - min(counts) <= 1


@MANY
@given(sizes=st.lists(st.sampled_from([2, 4, 8]), min_size=2, max_size=7), busy=st.lists(st.integers(1, 7), max_size=2),
       times=st.lists(st.sampled_from([F(1, 2), 1, 2, 2, 4]), max_size=6))
def test_copies_larger_than_a_machine_span_machines_of_their_own_kind_and_arch_in_equal_slots(sizes, busy, times):
    # H100 machines on x86_64 of a few sizes, some with a GPU taken, beside A100 and aarch64 machines;
    # copies of half, once, twice or four times the largest machine.
    fleet = [machine(n, name=f"gpu-{n}", gpus=gpus, taken={0: (1, 70)} if n in busy else None)
             for n, gpus in enumerate(sizes, start=1)]
    fleet += [machine(20, name="gpu-20", gpus=8, kind=A100), machine(21, name="gpu-21", gpus=8, arch="aarch64")]
    copies = [copy(f"c{n}", gpus=max(sizes) * size, memory_gb=30, deployment=n % 2) for n, size in enumerate(times)]
    result = plan(fleet, copies)
    assert result.placed == reference_placements(fleet, copies, (8100, 8199))
    for placement in result.placed:
        assert all(s.machine_id < 20 for s in placement.slots)
        assert len({len(s.gpu_indices) for s in placement.slots}) == 1
        assert len({s.machine_id for s in placement.slots}) == len(placement.slots)


def test_a_large_random_fleet_gives_the_plan_comparing_every_candidate_gives():
    rng = random.Random(7)
    fleet = [machine(n, name=f"gpu-{n}", gpus=rng.choice([4, 8]), kind=rng.choice(KINDS), arch=rng.choice(ARCHES),
                     taken={i: (rng.choice([F(1, 4), F(1, 2), 1]), 5) for i in range(rng.randint(0, 3))})
             for n in range(1, 61)]
    wanted = []
    for deployment in range(1, 40):
        kind, arch, gpus = rng.choice(KINDS), rng.choice(ARCHES), rng.choice(SIZES)
        memory = int(kind.memory_bytes * min(gpus, 1) * rng.uniform(0.3, 0.9))
        wanted += [CopyWanted(f"d{deployment}-c{n}", deployment, gpus, memory, kind, arch)
                   for n in range(rng.randint(1, 12))]
    result = plan(fleet, wanted)
    assert result.placed == reference_placements(fleet, wanted, (8100, 8199))
    assert len(result.placed) > 100 and result.unplaced
