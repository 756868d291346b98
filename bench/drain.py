#!/usr/bin/env python
"""The drain plan at the card's scale: 50 machines drained at once, of 1,000 with 10,000 copies.

    .venv/bin/python bench/drain.py                       # 1,000 machines, 10,000 copies, 50 drained, 20 runs
    .venv/bin/python bench/drain.py --draining 1 --runs 50
    .venv/bin/python bench/drain.py --profile             # where one plan spends its time

No database, no lab: deployments/drain_plan.py is pure, so this builds its input in memory (seeded,
the same every run) and times ``plan_drain(...)`` alone, the whole call: the rooms, every copy on
the drained machines moved or stopped, and the reasons. The fleet mixes 8 x H100 80GB, 8 x A100
40GB (x86_64), 8 x MI300X 192GB (AMD, x86_64) and 4 x GH200 96GB (aarch64), a few machines down or
draining already. The 10,000 copies belong to 500 deployments of 400 models, mostly shares and
single GPUs with a few of 2, 4, 8 and 16; placement itself put them there (not timed). A model's
files are on the machines its copies run on and on three more of the same kind. The plan gets all
10,000 copies (it keeps those with a slot on a drained machine) and 50 machines to drain, picked at
random among those with copies.

It prints the median and the fastest of --runs plans (after one that warms up), the median CPU time
(steadier than the clock when other processes share the CPUs), the moves and stops, and the most
common reasons. Goal: at most 50 ms for the whole call.
"""
import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import time
from collections import Counter, defaultdict
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.placement import A100, GH200, H100, MI300X  # noqa: E402 (placement's bench: the same kinds)
from deployments.drain_plan import CopyOnMachine, plan_drain  # noqa: E402 (after the path)
from deployments.placement import CopyWanted, Gpu, MachineRoom, plan  # noqa: E402

FLEET = [  # kind, GPUs a machine, arch, share of the machines
    (H100, 8, "x86_64", 0.55), (A100, 8, "x86_64", 0.20), (MI300X, 8, "x86_64", 0.15), (GH200, 4, "aarch64", 0.10),
]
SIZES = [(Fraction(1, 4), 50), (Fraction(1, 2), 30), (Fraction(1), 15), (Fraction(2), 3), (Fraction(4), 1.5),
         (Fraction(8), 0.4), (Fraction(16), 0.1)]
PORTS = (8100, 8199)


def world(machines: int, copies: int, deployments: int, models: int, rng: random.Random):
    """The machines with the copies placement put on them, the copies, and where each model's files are."""
    empty = []
    for number in range(machines):
        kind, size, arch, _ = rng.choices(FLEET, weights=[f[3] for f in FLEET])[0]
        state = rng.random()
        empty.append(MachineRoom(id=number + 1, name=f"gpu-{number + 1:04d}", arch=arch, up=state > 0.01,
                                 accepts_new=state > 0.02, gpus=tuple(Gpu(i, kind) for i in range(size))))
    per_deployment = [copies // deployments] * deployments
    for index in range(copies - sum(per_deployment)):
        per_deployment[index] += 1
    wanted, facts = [], {}
    per_deployment = [count + count // 20 for count in per_deployment]  # a little more: the first 10,000 placed are kept
    for deployment, count in enumerate(per_deployment, start=1):
        kind, _, arch, _ = rng.choices(FLEET, weights=[f[3] for f in FLEET])[0]
        gpus = rng.choices([s[0] for s in SIZES], weights=[s[1] for s in SIZES])[0]
        memory = int(kind.memory_bytes * float(min(gpus, 1)) * rng.uniform(0.4, 0.95))
        facts[deployment] = (f"model-{deployment}", 1 + rng.randrange(models), kind, arch, gpus, memory)
        wanted += [CopyWanted(f"d{deployment}-c{n}", deployment, gpus, memory, kind, arch) for n in range(1, count + 1)]
    placed = plan(empty, wanted, port_range=PORTS).placed[:copies]

    taken = defaultdict(lambda: [Fraction(0), 0])  # (machine, GPU) -> share, memory
    ports, here, on = defaultdict(set), defaultdict(Counter), []
    files = defaultdict(set)
    for number, placement in enumerate(placed, start=1):
        deployment = int(placement.key[1:].split("-")[0])
        name, model, kind, arch, gpus, memory = facts[deployment]
        for slot in placement.slots:
            for index in slot.gpu_indices:
                taken[(slot.machine_id, index)][0] += slot.share
                taken[(slot.machine_id, index)][1] += memory
            ports[slot.machine_id].add(slot.port)
            here[slot.machine_id][deployment] += 1
            files[model].add(slot.machine_id)
        on.append(CopyOnMachine(number, deployment, name, model, gpus, memory, kind, arch,
                                tuple(s.machine_id for s in placement.slots), number))
    by_kind = defaultdict(list)
    for machine in empty:
        by_kind[(machine.gpus[0].kind, machine.arch)].append(machine.id)
    for model, holders in files.items():  # three more machines of a kind that runs it
        some = next(iter(holders))
        machine = empty[some - 1]
        files[model] |= set(rng.sample(by_kind[(machine.gpus[0].kind, machine.arch)], 3))
    fleet = [MachineRoom(id=m.id, name=m.name, arch=m.arch, up=m.up, accepts_new=m.accepts_new,
                         gpus=tuple(Gpu(g.index, g.kind, *taken[(m.id, g.index)]) if (m.id, g.index) in taken else g
                                    for g in m.gpus),
                         ports_taken=frozenset(ports[m.id]), deployment_copies=dict(here[m.id])) for m in empty]
    rng.shuffle(fleet)
    return fleet, on, dict(files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machines", type=int, default=1000)
    parser.add_argument("--copies", type=int, default=10_000)
    parser.add_argument("--deployments", type=int, default=500)
    parser.add_argument("--models", type=int, default=400)
    parser.add_argument("--draining", type=int, default=50, help="machines drained at once")
    parser.add_argument("--runs", type=int, default=20, help="timed plans (after one that warms up)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="profile one plan instead of timing")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    machines, copies, files = world(args.machines, args.copies, args.deployments, args.models, rng)
    busy = sorted({m for c in copies for m in c.machines})
    draining = set(rng.sample(busy, min(args.draining, len(busy))))
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(plan_drain, machines, copies, draining, files, port_range=PORTS)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
        return

    result = plan_drain(machines, copies, draining, files, port_range=PORTS)  # warms up
    times, cpu_times = [], []
    for _ in range(args.runs):
        started, cpu_started = time.perf_counter(), time.process_time()
        again = plan_drain(machines, copies, draining, files, port_range=PORTS)
        times.append((time.perf_counter() - started) * 1000)
        cpu_times.append((time.process_time() - cpu_started) * 1000)
        assert again == result, "the plan changed between runs"

    gpus = sum(len(m.gpus) for m in machines)
    spanning = sum(len(c.machines) > 1 for c in copies if not draining.isdisjoint(c.machines))
    print(f"{args.machines} machines ({gpus} GPUs, {sum(not m.up for m in machines)} down, "
          f"{sum(m.up and not m.accepts_new for m in machines)} draining already), {len(copies)} copies of "
          f"{args.deployments} deployments; {len(draining)} drained at once; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    print()
    print(f"{'runs':>5}{'median ms':>11}{'min ms':>9}{'CPU ms':>9}{'copies':>8}{'moves':>7}{'stops':>7}{'spanning':>10}")
    print(f"{args.runs:>5}{statistics.median(times):>11.1f}{min(times):>9.1f}{statistics.median(cpu_times):>9.1f}"
          f"{result.copies:>8}{len(result.moves):>7}{len(result.stops):>7}{spanning:>10}")
    print("\nthe most common reasons:")
    for reason, count in Counter(s.reason for s in result.stops).most_common(6):
        print(f"  {count:>5}  {reason}")


if __name__ == "__main__":
    main()
