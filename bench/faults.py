#!/usr/bin/env python
"""Failures on a running three-machine lab cluster: when the console first showed each one, and
when the cluster read Running again. Writes the table to docs/resilience.md.

    sudo flock /tmp/fadenstack-lab-user.lock .venv/bin/python bench/faults.py          # the product's intervals
    sudo flock /tmp/fadenstack-lab-user.lock .venv/bin/python bench/faults.py --fast   # the lab tests' intervals

It brings the lab up (a state directory of its own), starts a whole console in processes of its
own (Daphne, a Celery worker and beat: tests/processes.py) on a throwaway SQLite database and
Redis database 6, enrols lab-a, lab-b and lab-c through the worker, starts a cluster on them
(lab-a the head, on the fabric network) and then, one at a time, on the running cluster:

- Ray killed on a worker (lab-b) and on the head (lab-a);
- lab-b's fabric link down for --link-down seconds, then up;
- a worker (lab-c) powered off until the console waits for it, then on (--no-worker-power: not);
- the head (lab-a) powered off until the cluster reads Failed after its restarts, then on.

From each fault on it polls the database (what the pages show) every 0.2 s. "First sign": a member
leaves Up, the cluster leaves Running or its reason is no longer empty, whichever comes first.
"Ready again": Running, every member Up, no reason. Every health check, job and state change it
saw is kept in the file's timelines. The lab goes down at the end, also after an error.
"""
import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.faults_report import SHOWN, report  # noqa: E402

POLL = 0.2
CLUSTER = "faults"
MACHINES = ("lab-a", "lab-b", "lab-c")
TICKS = {"FADEN_RETRY_TICK": 15, "FADEN_JOB_REAP_TICK": 15}  # beat schedule defaults in config/settings.py


class TimedOut(Exception):
    pass


@dataclass
class Snapshot:
    state: str
    reason: str
    members: dict  # name -> (state, display, reason)

    @property
    def all_up(self) -> bool:
        from clusters.choices import ClusterState, MemberState

        return (self.state == ClusterState.RUNNING and not self.reason
                and all(s == MemberState.JOINED for s, _, _ in self.members.values()))


@dataclass
class Row:
    failure: str
    first_sign: tuple[float, str] | None = None
    ready: float | None = None  # from the fault
    repaired_at: float | None = None  # power-on / link-up, from the fault
    failed_at: float | None = None  # the cluster read Failed, from the fault
    offline_at: tuple[float, str] | None = None  # the machines page read a machine Offline
    phase: float | None = None  # the fault came this long after the last scheduled check began
    did: list[str] = field(default_factory=list)
    timeline: list[tuple[float, str]] = field(default_factory=list)
    note: str = ""
    case: str = ""


class Watch:
    """The console's database from one fault on, polled every 0.2 s: every change an administrator
    would have seen on the cluster's page (states, words, checks, jobs) and on the machines' page."""

    def __init__(self, cluster_id: int, row: Row):
        from clusters.choices import CheckTrigger
        from clusters.models import HealthCheck
        from django.utils import timezone

        self.cluster_id, self.row = cluster_id, row
        self.last = self.snapshot()
        self.machines = self.machine_states()
        self.checks: set[int] = set()
        self.jobs: dict[int, str] = {}
        self.healthy_run: tuple[float, int, int] | None = None  # first began, count, its timeline line
        self.since = timezone.now()
        self.t0 = time.monotonic()
        scheduled = HealthCheck.objects.filter(cluster_id=cluster_id, trigger=CheckTrigger.SCHEDULE).first()
        if scheduled:
            row.phase = (self.since - scheduled.started_at).total_seconds()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def snapshot(self) -> Snapshot:
        from clusters.models import Cluster

        cluster = Cluster.objects.get(pk=self.cluster_id)
        members = {m.machine.name: (m.state, m.get_state_display(), m.state_reason)
                   for m in cluster.members.select_related("machine").order_by("machine__name")}
        return Snapshot(cluster.state, cluster.state_reason, members)

    def machine_states(self) -> dict:
        from machines.models import Machine

        return {m.name: (m.get_state_display(), m.state_reason) for m in Machine.objects.filter(membership__cluster_id=self.cluster_id)}

    def log(self, t: float, words: str) -> None:
        self.row.timeline.append((t, words))
        self.healthy_run = None

    def log_check(self, t: float, check) -> None:
        """A finished check; a run of checks that found all well is one line, and one entry of what the console did."""
        from clusters.choices import CheckOutcome

        began = (check.started_at - self.since).total_seconds()
        words = f"{check.get_outcome_display()} ({check.get_trigger_display().lower()}): {check.action}"
        if check.outcome == CheckOutcome.HEALTHY and self.healthy_run is not None:
            first, count, line = self.healthy_run
            self.row.timeline[line] = (self.row.timeline[line][0], f"checks that began from {first:+.1f} s to {began:+.1f} s "
                                                                   f"({count + 1} of them): {words}")
            self.row.did[-1] = f"{check.get_outcome_display()} ({check.get_trigger_display().lower()}) ×{count + 1}"
            self.healthy_run = (first, count + 1, line)
            return
        self.log(t, f"check ({check.get_trigger_display()}, began {began:+.1f} s, took {check.seconds:.1f} s) "
                    f"{check.get_outcome_display()}: {check.action}")
        self.row.did.append(words if check.outcome != CheckOutcome.HEALTHY else f"{check.get_outcome_display()} ({check.get_trigger_display().lower()})")
        if check.outcome == CheckOutcome.HEALTHY:
            self.healthy_run = (began, 1, len(self.row.timeline) - 1)

    def poll(self) -> Snapshot:
        from clusters.choices import MemberState
        from clusters.models import Cluster, HealthCheck
        from console.choices import JOB_TERMINAL
        from console.models import Job

        t = self.now()
        snap = self.snapshot()
        cluster_words = f"cluster {Cluster(state=snap.state).get_state_display()}" + (f": {snap.reason}" if snap.reason else "")
        if (snap.state, snap.reason) != (self.last.state, self.last.reason):
            self.log(t, cluster_words)
        member_words = []
        for name, (state, display, reason) in snap.members.items():
            words = f"{name} {display}" + (f": {reason}" if reason else "")
            if self.last.members.get(name) != (state, display, reason):
                self.log(t, words)
            if state != MemberState.JOINED:
                member_words.append(words)
        if self.row.first_sign is None and not snap.all_up:
            self.row.first_sign = (t, "; ".join(member_words) if member_words else cluster_words)
        machines = self.machine_states()
        for name, value in machines.items():
            if self.machines.get(name) != value:
                self.log(t, f"machine {name} {value[0]}" + (f": {value[1]}" if value[1] else ""))
                if value[0] == "Offline" and self.row.offline_at is None:
                    self.row.offline_at = (t, name)
        self.machines = machines
        for check in HealthCheck.objects.filter(cluster_id=self.cluster_id, finished_at__gte=self.since).exclude(
                pk__in=self.checks).order_by("finished_at"):
            self.checks.add(check.pk)
            self.log_check(t, check)
        for job in Job.objects.filter(target_type="cluster", target_id=self.cluster_id, created_at__gte=self.since).order_by("pk"):
            if job.pk not in self.jobs:
                self.log(t, f"job “{job.title}” queued")
            if job.state in JOB_TERMINAL and self.jobs.get(job.pk) not in JOB_TERMINAL:
                took = (job.finished_at - (job.started_at or job.created_at)).total_seconds()
                error = f": {job.error}" if job.error else ""
                self.log(t, f"job “{job.title}” {job.get_state_display().lower()} after {took:.1f} s{error}")
                short = error if len(error) < 160 else error[:157] + "…"
                self.row.did.append(f"job “{job.title}” {job.get_state_display().lower()} ({took:.0f} s){short}")
            self.jobs[job.pk] = job.state
        self.last = snap
        return snap

    def until(self, condition, *, timeout: float, what: str) -> float:
        """Poll until ``condition(snapshot)`` holds; seconds from the fault. TimedOut after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            began = time.monotonic()
            if condition(self.poll()):
                return self.now()
            if began > deadline:
                raise TimedOut(f"{what}: not within {timeout:.0f} s")
            time.sleep(max(0.0, POLL - (time.monotonic() - began)))

    def checked_since(self, when) -> bool:
        """A check that began at ``when`` or later has finished."""
        from clusters.models import HealthCheck

        return HealthCheck.objects.filter(pk__in=self.checks, started_at__gte=when).exists()

    def saw(self, outcome: str) -> bool:
        from clusters.models import HealthCheck

        return HealthCheck.objects.filter(pk__in=self.checks, outcome=outcome).exists()


class Bench:
    def __init__(self, args, intervals: dict, lab):
        from django.conf import settings

        self.args, self.lab = args, lab
        self.value = {name: int(intervals.get(name, getattr(settings, name, TICKS.get(name, 0)))) for name in {*SHOWN, *TICKS}}
        self.cluster_id = 0

    # -- the cases ---------------------------------------------------------------------------
    @property
    def sign_timeout(self) -> float:
        return 2 * self.value["FADEN_HEALTH_INTERVAL"] + self.value["FADEN_HEALTH_LOOK_AGAIN"] + 120

    def fault(self, row: Row, machine: str, *kind: str) -> Watch:
        watch = Watch(self.cluster_id, row)
        self.lab.fault(machine, *kind)
        watch.t0 = time.monotonic()  # the fault is in place
        return watch

    def ray_kill(self, machine: str, row: Row) -> None:
        watch = self.fault(row, machine, "ray-kill")
        watch.until(lambda s: not s.all_up, timeout=self.sign_timeout, what="a first sign")
        row.ready = watch.until(lambda s: s.all_up, timeout=900, what="Running again")

    def worker_ray(self, row: Row) -> None:
        self.ray_kill("lab-b", row)

    def head_ray(self, row: Row) -> None:
        self.ray_kill("lab-a", row)

    def worker_link(self, row: Row) -> None:
        """Down for --link-down seconds whatever the console shows meanwhile; afterwards, no sign
        once a check that began after link-up found all well."""
        from django.utils import timezone

        watch = self.fault(row, "lab-b", "link-down", "fabric")
        try:
            watch.until(lambda s: False, timeout=self.args.link_down, what="")
        except TimedOut:
            pass
        finally:
            self.lab.fault("lab-b", "link-up", "fabric")
            row.repaired_at, up = watch.now(), timezone.now()
        watch.until(lambda s: row.first_sign is not None or watch.checked_since(up), timeout=self.sign_timeout, what="a check after link-up")
        if row.first_sign is None:
            row.note = f"Nothing showed: the cluster never left Running (watched {watch.now():.0f} s, until a check after link-up)."
            return
        row.ready = watch.until(lambda s: s.all_up, timeout=900, what="Running again")

    def worker_partition(self, row: Row) -> None:
        """Down until the console shows it (Ray marks the node dead first), then up."""
        watch = self.fault(row, "lab-b", "link-down", "fabric")
        try:
            watch.until(lambda s: not s.all_up, timeout=self.sign_timeout + 300, what="a first sign")
        finally:
            self.lab.fault("lab-b", "link-up", "fabric")
            row.repaired_at = watch.now()
        row.ready = watch.until(lambda s: s.all_up, timeout=900, what="Running again")

    def worker_power(self, row: Row) -> None:
        from clusters.choices import CheckOutcome

        watch = self.fault(row, "lab-c", "power-off")
        try:  # off until the console says it waits for lab-c, as it does while a worker is offline
            watch.until(lambda s: watch.saw(CheckOutcome.WAITING), timeout=self.sign_timeout + self.value["FADEN_OFFLINE_AFTER"],
                        what="a check that waits for lab-c")
        except TimedOut as exc:
            row.note = f"Powered on without a check that waited for lab-c ({exc})."
        self.lab.fault("lab-c", "power-on")
        row.repaired_at = watch.now()
        row.ready = watch.until(lambda s: s.all_up, timeout=900, what="Running again")

    def head_power(self, row: Row) -> None:
        from clusters.choices import ClusterState

        v = self.value
        pauses = sum(v["FADEN_RESTART_PAUSE"] * 2 ** i for i in range(v["FADEN_RESTART_ATTEMPTS"] - 1))
        timeout = self.sign_timeout + pauses + v["FADEN_RESTART_ATTEMPTS"] * (v["FADEN_RETRY_TICK"] + 240)
        watch = self.fault(row, "lab-a", "power-off")
        try:
            row.failed_at = watch.until(lambda s: s.state == ClusterState.FAILED, timeout=timeout, what="Failed")
        finally:
            self.lab.fault("lab-a", "power-on")
            row.repaired_at = watch.now()
        row.ready = watch.until(lambda s: s.all_up, timeout=900, what="Running again")

    CASES = {
        "worker-ray": ("Ray killed on a worker (lab-b)", worker_ray),
        "head-ray": ("Ray killed on the head (lab-a)", head_ray),
        "worker-link": ("lab-b's fabric link down {link} s, then up", worker_link),
        "worker-partition": ("lab-b's fabric link down until the console shows it, then up", worker_partition),
        "worker-power": ("A worker (lab-c) powered off until the console waits for it, then on", worker_power),
        "head-power": ("The head (lab-a) powered off until Failed, then on", head_power),
    }

    def settle(self) -> None:
        """Every fault undone, then Running with every member Up, no operation under way, no check
        looking, and the check a start queues 2 s after it ended done: the next fault meets a quiet cluster."""
        from datetime import timedelta

        from django.utils import timezone

        from clusters import selectors
        from clusters.choices import CheckOutcome
        from clusters.models import Cluster, HealthCheck
        from console.models import Job
        from tests.harness import all_up

        self.lab.heal()

        def quiet() -> bool:
            cluster = Cluster.objects.get(pk=self.cluster_id)
            if not all_up(CLUSTER, len(MACHINES)) or selectors.cluster_busy(cluster):
                return False
            latest = cluster.health_checks.first()
            if latest and latest.outcome == CheckOutcome.LOOK_AGAIN:
                return False  # its second look is due
            if HealthCheck.objects.filter(cluster=cluster, outcome=CheckOutcome.RUNNING).exists():
                return False
            ended = Job.objects.filter(target_type="cluster", target_id=cluster.pk, finished_at__isnull=False).order_by("-finished_at").first()
            return not ended or ended.finished_at < timezone.now() - timedelta(seconds=6)

        deadline = time.monotonic() + 900
        while not quiet():
            if time.monotonic() > deadline:
                raise TimedOut("the cluster did not read Running with every machine Up and quiet again within 900 s")
            time.sleep(1)

    def run(self, names: list[str]) -> list[Row]:
        rows = []
        self.settle()
        runs = self.args.runs
        for name in [name for name in names for _ in range(runs)]:
            title, case = self.CASES[name]
            row = Row(title.format(link=self.args.link_down))
            if runs > 1:
                row.failure += f", run {sum(1 for r in rows if r.case == name) + 1} of {runs}"
            row.case = name
            print(f"-- {row.failure}", flush=True)
            started = time.monotonic()
            try:
                case(self, row)
            except TimedOut as exc:
                row.note = (row.note + " " if row.note else "") + f"Gave up: {exc}."
            for t, words in row.timeline:
                print(f"   {t:7.1f} s  {words}", flush=True)
            print(f"   ({time.monotonic() - started:.0f} s)", flush=True)
            rows.append(row)
            try:
                self.settle()
            except TimedOut as exc:
                row.note = (row.note + " " if row.note else "") + f"Afterwards: {exc}; the remaining failures were not run."
                break
        return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="the lab tests' shortened intervals instead of the product's")
    parser.add_argument("--health-interval", type=int, help="FADEN_HEALTH_INTERVAL (s); stated in the report")
    parser.add_argument("--restart-pause", type=int, help="FADEN_RESTART_PAUSE (s); stated in the report")
    parser.add_argument("--link-down", type=float, default=20, help="seconds lab-b's fabric link stays down (default 20)")
    parser.add_argument("--no-worker-power", action="store_true", help="leave out the worker powered off")
    parser.add_argument("--runs", type=int, default=1, help="each case this many times (the report adds median and worst)")
    parser.add_argument("--cases", help=f"a comma-separated subset of {','.join(Bench.CASES)}")
    parser.add_argument("--out", default=str(ROOT / "docs/resilience.md"))
    args = parser.parse_args()
    names = args.cases.split(",") if args.cases else [n for n in Bench.CASES if not (args.no_worker_power and n == "worker-power")]
    if unknown := set(names) - set(Bench.CASES):
        parser.error(f"unknown cases: {', '.join(sorted(unknown))}")

    started = time.monotonic()
    data_dir = Path(tempfile.mkdtemp(prefix="fadenstack-bench-"))
    os.environ.update(
        FADEN_DATA_DIR=str(data_dir),
        FADEN_LAB_DIR=str(data_dir / "lab"),
        DATABASE_URL=f"sqlite:///{data_dir}/bench.sqlite3",
        REDIS_URL=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/6"),
        DJANGO_SETTINGS_MODULE="config.settings",
        FADEN_CELERY_EAGER="0",
        FADEN_LOG_LEVEL="WARNING",
    )
    import django

    django.setup()
    from django.core.management import call_command

    from tests.harness import INTERVALS, console_lab, enrol, images_import, running
    from tests.processes import console_processes

    intervals, stated = (dict(INTERVALS), ["Shortened intervals (--fast, the lab tests' own)"]) if args.fast else ({}, [])
    for option, name in (("health_interval", "FADEN_HEALTH_INTERVAL"), ("restart_pause", "FADEN_RESTART_PAUSE")):
        if getattr(args, option) is not None:
            intervals[name] = str(getattr(args, option))
            stated.append(f"{name}={intervals[name]} instead of the default (--{option.replace('_', '-')})")

    call_command("migrate", verbosity=0)
    lab = console_lab(data_dir / "lab")
    bench = Bench(args, intervals, lab)
    lab.up()
    try:
        with console_processes(beat=True, env=intervals, enqueue=True):
            machines = enrol(lab, *MACHINES, timeout=120)
            images_import(lab, None, data_dir / "images")  # the real image: Ray runs in Podman
            bench.cluster_id = running(CLUSTER, machines, timeout=300).pk
            print(f"cluster {CLUSTER} running on {', '.join(MACHINES)} after {time.monotonic() - started:.0f} s", flush=True)
            rows = bench.run(names)
    finally:
        lab.run("down", check=False)
    wall = time.monotonic() - started
    command = " ".join([".venv/bin/python", os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    text = report(bench, rows, command=command, wall=wall, stated=stated)
    Path(args.out).write_text(text)
    print(text)
    print(f"written to {args.out} ({wall / 60:.1f} minutes)")


if __name__ == "__main__":
    main()
