#!/usr/bin/env python
"""The placement planner at the card's scale: 1,000 machines and 10,000 copies in one plan.

    .venv/bin/python bench/placement.py                       # 1,000 machines, 10,000 copies, 20 runs
    .venv/bin/python bench/placement.py --machines 100 --copies 1000 --runs 50
    .venv/bin/python bench/placement.py --shuffled            # the copies in random order, not deployment by deployment
    .venv/bin/python bench/placement.py --profile             # where one plan spends its time

No database, no lab: deployments/placement.py is pure, so this builds its input in memory (seeded,
the same every run) and times ``plan(...)`` alone, the whole call: grouping the machines, placing
every copy in order and the reasons for those refused. The fleet mixes 8 x H100 80GB and
8 x A100 40GB (x86_64), 4 x MI300X 192GB (AMD, x86_64) and 4 x GH200 96GB (aarch64); a quarter of
the machines have copies on them already (whole GPUs, shares, their memory and ports), a few are
down or draining. The copies belong to ~500 deployments of mixed sizes (a quarter, a half, 1, 2, 4,
8 and 16 GPUs), each on one kind and arch, asked for deployment by deployment; there are more
than the fleet holds, so the refusals are timed too.

It prints the median and the fastest of --runs plans (after one that warms up), the median of the
CPU time the process spent on each (steadier than the clock when other processes share the CPUs),
what was placed and refused, and the most common reasons. Goal: at most 50 ms for the whole call.
"""
import argparse
import cProfile
import os
import pstats
import random
import statistics
import sys
import time
from collections import Counter
from fractions import Fraction
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deployments.placement import CopyWanted, Gpu, GpuKind, MachineRoom, plan  # noqa: E402 (after the path)

GIB = 1 << 30
H100 = GpuKind("nvidia", "H100", 80 * GIB)
A100 = GpuKind("nvidia", "A100", 40 * GIB)
MI300X = GpuKind("amd", "Instinct MI300X", 192 * GIB)
GH200 = GpuKind("nvidia", "GH200", 96 * GIB)
FLEET = [  # kind, GPUs a machine, arch, share of the machines
    (H100, 8, "x86_64", 0.55), (A100, 8, "x86_64", 0.20), (MI300X, 4, "x86_64", 0.15), (GH200, 4, "aarch64", 0.10),
]
# Copies' sizes in GPUs and how often each comes up: mostly small models, a few large ones.
SIZES = [(Fraction(1, 4), 20), (Fraction(1, 2), 20), (Fraction(1), 30), (Fraction(2), 14), (Fraction(4), 9),
         (Fraction(8), 5), (Fraction(16), 2)]
PORTS = (8100, 8199)


def fleet(count: int, rng: random.Random) -> list[MachineRoom]:
    machines = []
    for number in range(count):
        kind, size, arch, _ = rng.choices(FLEET, weights=[f[3] for f in FLEET])[0]
        gpus, ports = [], set()
        busy = rng.random() < 0.25  # copies on it already
        for index in range(size):
            roll = rng.random() if busy else 1.0
            if roll < 0.3:  # a whole-GPU copy
                gpus.append(Gpu(index, kind, Fraction(1), int(kind.memory_bytes * 0.9)))
                ports.add(PORTS[0] + len(ports))
            elif roll < 0.5:  # one to three quarters
                quarters = rng.randint(1, 3)
                gpus.append(Gpu(index, kind, Fraction(quarters, 4), kind.memory_bytes * quarters // 5))
                ports.update(PORTS[0] + len(ports) + n for n in range(quarters))
            else:
                gpus.append(Gpu(index, kind))
        state = rng.random()
        machines.append(MachineRoom(
            id=number + 1, name=f"gpu-{number + 1:04d}", arch=arch, up=state > 0.02, accepts_new=state > 0.04,
            gpus=tuple(gpus), ports_taken=frozenset(ports),
        ))
    rng.shuffle(machines)  # the planner sorts by id itself
    return machines


def copies(count: int, deployments: int, rng: random.Random) -> list[CopyWanted]:
    per_deployment = [1 + rng.randrange(2 * count // deployments - 1) for _ in range(deployments)]
    while sum(per_deployment) != count:  # to exactly --copies, a copy at a time
        index = rng.randrange(deployments)
        per_deployment[index] += 1 if sum(per_deployment) < count else -1 if per_deployment[index] > 1 else 0
    wanted = []
    for deployment, number in enumerate(per_deployment, start=1):
        kind, _, arch, _ = rng.choices(FLEET, weights=[f[3] for f in FLEET])[0]
        gpus = rng.choices([s[0] for s in SIZES], weights=[s[1] for s in SIZES])[0]
        share = min(gpus, 1)
        memory = int(kind.memory_bytes * float(share) * rng.uniform(0.4, 0.95))
        wanted += [CopyWanted(f"d{deployment}-c{n}", deployment, gpus, memory, kind, arch) for n in range(1, number + 1)]
    return wanted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machines", type=int, default=1000)
    parser.add_argument("--copies", type=int, default=10_000)
    parser.add_argument("--deployments", type=int, default=500)
    parser.add_argument("--runs", type=int, default=20, help="timed plans (after one that warms up)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--shuffled", action="store_true",
                        help="ask for the copies in random order (the slowest: each copy's deployment's machines are set aside anew)")
    parser.add_argument("--profile", action="store_true", help="profile one plan instead of timing")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    machines = fleet(args.machines, rng)
    wanted = copies(args.copies, args.deployments, rng)
    if args.shuffled:
        rng.shuffle(wanted)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.runcall(plan, machines, wanted, port_range=PORTS)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
        return

    result = plan(machines, wanted, port_range=PORTS)  # warms up; the timed runs give the same plan
    times, cpu_times = [], []
    for _ in range(args.runs):
        started, cpu_started = time.perf_counter(), time.process_time()
        again = plan(machines, wanted, port_range=PORTS)
        times.append((time.perf_counter() - started) * 1000)
        cpu_times.append((time.process_time() - cpu_started) * 1000)
        assert again == result, "the plan changed between runs"

    gpus = sum(len(m.gpus) for m in machines)
    placed_gpus = sum(len(s.gpu_indices) * s.share for p in result.placed for s in p.slots)
    print(f"{args.machines} machines ({gpus} GPUs, {sum(not m.up for m in machines)} down, "
          f"{sum(m.up and not m.accepts_new for m in machines)} draining), {len(wanted)} copies of "
          f"{args.deployments} deployments{', shuffled' if args.shuffled else ''}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print()
    print(f"{'runs':>5}{'median ms':>11}{'min ms':>9}{'CPU ms':>9}{'placed':>8}{'unplaced':>10}{'GPUs placed':>13}"
          f"{'spanning':>10}")
    spanning = sum(len(p.slots) > 1 for p in result.placed)
    print(f"{args.runs:>5}{statistics.median(times):>11.1f}{min(times):>9.1f}{statistics.median(cpu_times):>9.1f}"
          f"{len(result.placed):>8}{len(result.unplaced):>10}{float(placed_gpus):>13.2f}{spanning:>10}")
    print("\nthe most common reasons:")
    for reason, count in Counter(u.reason for u in result.unplaced).most_common(6):
        print(f"  {count:>5}  {reason}")


if __name__ == "__main__":
    main()
