"""The drain plan (deployments/drain_plan.py): each rule and each reason by example, then properties
over generated clusters: every copy on a drained machine moves or stops with a reason, a move goes only
where the rules allow, no GPU is over-committed, and the same input gives the same plan."""
import random
from collections import defaultdict
from fractions import Fraction as F

from hypothesis import given, settings
from hypothesis import strategies as st

from deployments.drain_plan import (
    CopyOnMachine,
    DrainPlan,
    Move,
    Stop,
    Target,
    button_label,
    move_words,
    plan_drain,
    stop_words,
)
from deployments.placement import Gpu, GpuKind, MachineRoom

GB = 1 << 30
H100 = GpuKind("nvidia", "H100", 80 * GB)
A100 = GpuKind("nvidia", "A100", 40 * GB)
NAMES = "abcdefghijklmnopqrstuvwxyz"


def machine(id, gpus=4, kind=H100, arch="x86_64", taken=None, **extra):
    """``taken``: {GPU index: (share, GB of memory)} that copies hold already."""
    taken = taken or {}
    return MachineRoom(
        id=id, name=f"lab-{NAMES[id - 1]}", arch=arch,
        gpus=tuple(Gpu(i, kind, F(taken[i][0]), int(taken[i][1] * GB)) if i in taken else Gpu(i, kind)
                   for i in range(gpus)),
        **extra,
    )


def copy(id=1, machines=(1,), gpus=1, memory_gb=60, name="llama-8b", model=1, deployment=1, kind=H100, arch="x86_64"):
    return CopyOnMachine(id=id, deployment=deployment, name=name, model=model, gpus=F(gpus),
                         memory_per_gpu_bytes=int(memory_gb * GB), kind=kind, arch=arch, machines=tuple(machines),
                         number=id)


def where(plan):
    return {m.copy: [(t.machine_id, t.gpu_indices, t.port) for t in m.slots] for m in plan.moves}


def why(plan):
    return {s.copy: s.reason for s in plan.stops}


# ------------------------------------------------------------------ the rules, by example

def test_a_copy_moves_to_another_machine_that_holds_its_models_files():
    fleet = [machine(1, taken={0: (1, 60)}, ports_taken=frozenset({8100})), machine(2), machine(3)]
    plan = plan_drain(fleet, [copy()], {1}, {1: {1, 3}})
    assert where(plan) == {1: [(3, (0,), 8100)]}
    assert plan.stops == []


def test_a_copy_stops_when_no_other_machine_holds_the_model_files():
    plan = plan_drain([machine(1, taken={0: (1, 60)}), machine(2)], [copy()], {1}, {1: {1}})
    assert why(plan) == {1: "no other machine holds llama-8b's files"}


def test_a_copy_of_a_model_nobody_holds_stops_with_the_same_words():
    plan = plan_drain([machine(1, taken={0: (1, 60)}), machine(2)], [copy()], {1}, {})
    assert why(plan) == {1: "no other machine holds llama-8b's files"}


def test_a_plan_for_several_machines_never_moves_a_copy_onto_one_of_them():
    fleet = [machine(1, taken={0: (1, 60)}), machine(2, taken={0: (1, 60)}), machine(3)]
    copies = [copy(1, machines=(1,)), copy(2, machines=(2,), deployment=2, name="qwen", model=2)]
    plan = plan_drain(fleet, copies, {1, 2}, {1: {1, 2}, 2: {1, 2, 3}})
    assert why(plan) == {1: "no other machine holds llama-8b's files"}
    assert where(plan) == {2: [(3, (0,), 8100)]}


def test_a_machine_draining_already_or_leaving_takes_nothing_and_is_named():
    fleet = [machine(1, taken={0: (1, 60)}), machine(2, accepts_new=False)]
    plan = plan_drain(fleet, [copy()], {1}, {1: {1, 2}})
    assert why(plan) == {1: "no other machine that holds llama-8b's files takes copies (lab-b is draining or leaving)"}


def test_a_full_machine_is_said_so_with_the_one_draining_already_that_had_room():
    fleet = [machine(1, taken={0: (1, 60)}), machine(2, gpus=1, taken={0: (1, 60)}), machine(3, accepts_new=False)]
    plan = plan_drain(fleet, [copy()], {1}, {1: {1, 2, 3}})
    assert why(plan) == {1: "no machine has a free H100 80GB; lab-c has room, but it is draining"}


def test_a_copy_stops_when_the_machines_holding_the_files_are_down():
    fleet = [machine(1, taken={0: (1, 60)}), machine(2, up=False), machine(3)]
    plan = plan_drain(fleet, [copy()], {1}, {1: {1, 2}})
    assert why(plan) == {1: "no other machine that holds llama-8b's files is up (lab-b is down)"}


def test_a_copy_stops_when_the_machines_holding_the_files_have_another_kind():
    fleet = [machine(1, taken={0: (1, 60)}), machine(2, kind=A100), machine(3, arch="aarch64")]
    plan = plan_drain(fleet, [copy()], {1}, {1: {1, 2, 3}})
    assert why(plan) == {1: "no other machine that holds llama-8b's files has H100 80GB on x86_64"}


def test_a_copy_stops_when_no_machine_holding_the_files_has_the_gpus_free():
    fleet = [machine(1, taken={0: (1, 60), 1: (1, 60)}), machine(2, taken={0: (1, 60), 1: (1, 60), 2: (1, 60)}),
             machine(3)]
    plan = plan_drain(fleet, [copy(gpus=2, machines=(1,))], {1}, {1: {1, 2}})
    assert why(plan) == {1: "no machine has 2 free H100 80GB (the most free on one is 1, on lab-b)"}


def test_a_share_stops_when_the_gpu_memory_is_short_and_the_sentence_says_how_much():
    fleet = [machine(1, taken={0: (F(1, 4), 38)}), machine(3, taken={i: (F(1, 2), 50) for i in range(4)})]
    plan = plan_drain(fleet, [copy(gpus=F(1, 4), memory_gb=38)], {1}, {1: {1, 3}})
    assert why(plan) == {1: "not enough GPU memory free on lab-c: 30 GiB of the 38 GiB the copy needs"}


def test_a_share_moves_onto_a_gpu_with_the_quarters_and_the_memory_free():
    fleet = [machine(1, taken={0: (F(1, 4), 20)}), machine(2, taken={i: (F(1, 2), 50) for i in range(4)})]
    plan = plan_drain(fleet, [copy(gpus=F(1, 4), memory_gb=20)], {1}, {1: {1, 2}})
    assert where(plan) == {1: [(2, (0,), 8100)]}
    assert plan.moves[0].slots[0].share == F(1, 4)


def test_moves_are_placed_one_after_another_so_the_second_finds_the_first_took_the_gpu():
    fleet = [machine(1, taken={0: (1, 60), 1: (1, 60)}), machine(2, gpus=1)]
    copies = [copy(1), copy(2)]
    plan = plan_drain(fleet, copies, {1}, {1: {1, 2}})
    assert where(plan) == {1: [(2, (0,), 8100)]}
    assert why(plan) == {2: "no machine has a free H100 80GB"}


def test_a_copy_spanning_a_drained_machine_moves_whole_and_keeps_its_other_slot_held():
    fleet = [machine(1, taken={i: (1, 60) for i in range(4)}), machine(2, taken={i: (1, 60) for i in range(4)}),
             machine(3), machine(4)]
    plan = plan_drain(fleet, [copy(gpus=8, machines=(1, 2))], {1}, {1: {1, 2, 3, 4}})
    assert where(plan) == {1: [(3, (0, 1, 2, 3), 8100), (4, (0, 1, 2, 3), 8100)]}


def test_a_copy_spanning_a_drained_machine_stops_when_it_cannot_move_whole():
    fleet = [machine(1, taken={i: (1, 60) for i in range(4)}), machine(2, taken={i: (1, 60) for i in range(4)}),
             machine(3)]
    plan = plan_drain(fleet, [copy(gpus=8, machines=(2, 1))], {1}, {1: {1, 2, 3}})
    assert why(plan) == {1: "the copy spans 2 machines with 4 free H100 80GB each, and only 1 has them (lab-c)"}


def test_copies_on_machines_not_drained_are_not_part_of_the_plan():
    fleet = [machine(1, taken={0: (1, 60)}), machine(2, taken={0: (1, 60)}), machine(3)]
    plan = plan_drain(fleet, [copy(1, machines=(1,)), copy(2, machines=(2,))], {1}, {1: {1, 2, 3}})
    assert plan.copies == 1 and where(plan) == {1: [(3, (0,), 8100)]}


def test_the_card_words_for_a_move_a_stop_and_the_button():
    move = Move(7, (Target(3, "lab-c", (0, 1), F(1), 8101),))
    assert move_words(move) == "Moves to lab-c (GPUs 0,1 · port 8101)"
    assert move.to == 3 and move.to_name == "lab-c"
    assert move_words(Move(7, (Target(3, "lab-c", (2,), F(1, 4), 8100),))) == "Moves to lab-c (GPU 2, a quarter · port 8100)"
    spans = Move(7, (Target(3, "lab-c", (0, 1), F(1), 8101), Target(4, "lab-d", (0, 1), F(1), 8100)))
    assert move_words(spans) == "Moves to lab-c (GPUs 0,1 · port 8101) and lab-d (GPUs 0,1 · port 8100)"
    stop = Stop(8, "no other machine holds llama-8b's files")
    assert stop_words(stop) == "Stops: no other machine holds llama-8b's files"
    assert button_label(DrainPlan([move], [])) == "Drain"
    assert button_label(DrainPlan([move], [stop, stop])) == "Drain and stop 2"
    assert button_label(DrainPlan([move], []), remove=True) == "Remove"
    assert button_label(DrainPlan([], [stop]), remove=True) == "Remove and stop 1"


# ------------------------------------------------------------------ properties over generated clusters

KINDS = [(H100, "x86_64"), (A100, "x86_64"), (H100, "aarch64")]
SIZES = [F(1, 4), F(1, 2), F(1), F(2), F(4), F(8)]


@st.composite
def clusters(draw):
    """A cluster with copies placed on it (by a simple first-fit, as the console would have left them),
    which machines hold which model's files, and some machines to drain."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = random.Random(seed)
    count = draw(st.integers(2, 10))
    specs = []
    for number in range(1, count + 1):
        kind, arch = KINDS[rng.randrange(len(KINDS))] if rng.random() < 0.4 else KINDS[0]
        specs.append((number, kind, arch, rng.choice([1, 2, 4, 4]), rng.random() > 0.1, rng.random() > 0.1))
    spare = {number for number in range(1, count + 1) if rng.random() < 0.3}  # no copy on them yet: room to move to
    share = defaultdict(F)
    memory = defaultdict(int)
    ports = defaultdict(set)
    copies = []
    models = rng.randint(1, 4)
    for copy_id in range(1, draw(st.integers(0, 14)) + 1):
        model = rng.randint(1, models)
        kind, arch = KINDS[0] if model % 2 else KINDS[rng.randrange(len(KINDS))]
        gpus = rng.choice(SIZES)
        need = int(kind.memory_bytes * min(gpus, 1) * rng.uniform(0.2, 1.0))
        mine = [s for s in specs if s[1] == kind and s[2] == arch and s[0] not in spare]
        if not mine:
            continue
        slots, left = [], gpus
        per = min(gpus, max(s[3] for s in mine))
        for number, _, _, size, _, _ in rng.sample(mine, len(mine)):
            if left <= 0:
                break
            fits = [i for i in range(size) if share[(number, i)] + min(per, 1) <= 1
                    and memory[(number, i)] + need <= kind.memory_bytes]
            want = max(1, int(per))
            if len(fits) >= want and per <= size:
                slots.append((number, fits[:want]))
                left -= per
        if left > 0:
            continue
        for number, indices in slots:
            for index in indices:
                share[(number, index)] += min(per, 1)
                memory[(number, index)] += need
            ports[number].add(8100 + len(ports[number]))
        copies.append(CopyOnMachine(copy_id, deployment=model * 10 + int(gpus * 4), name=f"model-{model}",
                                    model=model, gpus=gpus, memory_per_gpu_bytes=need, kind=kind, arch=arch,
                                    machines=tuple(n for n, _ in slots), number=copy_id))
    machines = [MachineRoom(id=number, name=f"lab-{NAMES[number - 1]}", arch=arch, up=up, accepts_new=taking,
                            gpus=tuple(Gpu(i, kind, share[(number, i)], memory[(number, i)]) for i in range(size)),
                            ports_taken=frozenset(ports[number]))
                for number, kind, arch, size, up, taking in specs]
    files = {model: {n for n in range(1, count + 1) if rng.random() < 0.6} for model in range(1, models + 1)}
    for c in copies:
        files[c.model].update(c.machines)
    draining = set(draw(st.sets(st.integers(1, count), min_size=1, max_size=min(3, count))))
    return machines, copies, draining, files


@given(clusters())
@settings(max_examples=300, deadline=None)
def test_every_copy_on_a_drained_machine_moves_or_stops_with_a_reason(world):
    machines, copies, draining, files = world
    plan = plan_drain(machines, copies, draining, files)
    on_drained = sorted(c.id for c in copies if set(c.machines) & draining)
    assert sorted([m.copy for m in plan.moves] + [s.copy for s in plan.stops]) == on_drained
    assert all(s.reason.strip() for s in plan.stops)


@given(clusters())
@settings(max_examples=300, deadline=None)
def test_a_move_goes_only_where_the_files_are_on_a_machine_up_taking_copies_of_the_kind_with_room(world):
    machines, copies, draining, files = world
    plan = plan_drain(machines, copies, draining, files)
    by_id = {m.id: m for m in machines}
    of = {c.id: c for c in copies}
    for move in plan.moves:
        moving = of[move.copy]
        assert sum(len(t.gpu_indices) * t.share for t in move.slots) == moving.gpus
        for target in move.slots:
            room = by_id[target.machine_id]
            assert target.machine_id in files[moving.model]
            assert target.machine_id not in draining and room.up and room.accepts_new
            assert room.arch == moving.arch and target.machine_name == room.name
            for index in target.gpu_indices:
                gpu = room.gpus[index]
                assert gpu.kind == moving.kind
                assert gpu.share_taken + target.share <= 1
                assert gpu.memory_taken_bytes + moving.memory_per_gpu_bytes <= gpu.kind.memory_bytes
            assert target.port not in room.ports_taken


@given(clusters())
@settings(max_examples=300, deadline=None)
def test_the_moves_together_never_over_commit_a_gpu_or_a_port(world):
    machines, copies, draining, files = world
    plan = plan_drain(machines, copies, draining, files)
    by_id = {m.id: m for m in machines}
    of = {c.id: c for c in copies}
    share, memory, ports = defaultdict(F), defaultdict(int), set()
    for move in plan.moves:
        for target in move.slots:
            assert (target.machine_id, target.port) not in ports
            ports.add((target.machine_id, target.port))
            for index in target.gpu_indices:
                share[(target.machine_id, index)] += target.share
                memory[(target.machine_id, index)] += of[move.copy].memory_per_gpu_bytes
    for (machine_id, index), added in share.items():
        gpu = by_id[machine_id].gpus[index]
        assert gpu.share_taken + added <= 1
        assert gpu.memory_taken_bytes + memory[(machine_id, index)] <= gpu.kind.memory_bytes


@given(clusters(), st.randoms(use_true_random=False))
@settings(max_examples=200, deadline=None)
def test_the_same_input_in_any_order_gives_the_same_plan(world, rng):
    machines, copies, draining, files = world
    plan = plan_drain(machines, copies, draining, files)
    assert plan_drain(machines, copies, draining, files) == plan
    machines, copies = list(machines), list(copies)
    rng.shuffle(machines)
    rng.shuffle(copies)
    shuffled_files = {model: set(rng.sample(sorted(held), len(held))) for model, held in files.items()}
    assert plan_drain(machines, copies, set(draining), shuffled_files) == plan


@given(st.integers(3, 8), st.sets(st.integers(3, 8)), st.dictionaries(st.integers(3, 8), st.integers(0, 4)),
       st.sampled_from([(1,), (2,), (1, 2)]))
@settings(max_examples=200, deadline=None)
def test_a_copy_spanning_machines_moves_whole_onto_free_gpus_of_machines_holding_the_files_or_stops(
        count, holders, busy, draining):
    """A copy of 8 on lab-a and lab-b (4 H100 each), the others with some GPUs taken already."""
    fleet = [machine(1, taken={i: (1, 60) for i in range(4)}), machine(2, taken={i: (1, 60) for i in range(4)})]
    fleet += [machine(n, taken={i: (1, 60) for i in range(busy.get(n, 0))}) for n in range(3, count + 1)]
    plan = plan_drain(fleet, [copy(gpus=8, machines=(1, 2))], set(draining), {1: {1, 2} | holders})
    if plan.moves:
        [move] = plan.moves
        assert len(move.slots) == 2 and all(len(t.gpu_indices) == 4 for t in move.slots)
        assert {t.machine_id for t in move.slots} <= holders - set(draining)
        assert all(busy.get(t.machine_id, 0) == 0 for t in move.slots)
    else:
        free = [n for n in holders if n <= count and busy.get(n, 0) == 0]
        assert len(free) < 2 and plan.stops[0].reason


# ------------------------------------------------------------------ placement held to some machines

def test_room_a_copy_held_to_some_machines_takes_is_taken_for_the_copies_after_it_and_what_it_left_stays_free():
    from deployments.placement import PORT_RANGE, CopyWanted
    from deployments.placement_state import PlanState

    state = PlanState([machine(1, gpus=1), machine(2, gpus=2)], PORT_RANGE)
    wanted = [CopyWanted(f"d{n}-c1", n, F(1), 60 * GB, H100, "x86_64") for n in (1, 2, 3, 4)]
    first = state.place(1, state.want(wanted[0], only=frozenset({2})))
    assert [(m, gpus) for m, gpus, _, _ in first] == [(2, (0,))]
    # The whole group's heaps are built again: lab-b's second GPU is still free, its first is not.
    placed = [state.place(n + 1, want) for n, want in enumerate(map(state.want, wanted[1:]), start=1)]
    assert sorted((slots[0][0], slots[0][1]) for slots in placed if slots) == [(1, (0,)), (2, (1,))]
    assert placed.count(None) == 1
