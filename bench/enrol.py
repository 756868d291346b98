#!/usr/bin/env python
"""Enrol every machine of a lab spec at once, through a real Celery worker, and time it.

    sudo .venv/bin/python bench/enrol.py                          # the default lab (5 machines)
    sudo .venv/bin/python bench/enrol.py --spec lab/specs/twenty.toml

It brings the lab up (unless --keep-lab finds one up), enrols one machine
alone for the baseline, deletes it, then enrols all of them at once, and
prints each machine's enrolment time and the totals. Uses its own SQLite
database and Redis database 15, so a running console is not disturbed.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=str(ROOT / "lab/specs/default.toml"))
    parser.add_argument("--keep-lab", action="store_true", help="use the lab that is up and leave it up")
    args = parser.parse_args()

    data_dir = tempfile.mkdtemp(prefix="fadenstack-bench-")
    os.environ.update(
        FADEN_DATA_DIR=data_dir,
        DATABASE_URL=f"sqlite:///{data_dir}/bench.sqlite3",
        REDIS_URL=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15"),
        FADEN_CONSOLE_URL="http://198.18.0.1:9",  # heartbeats go nowhere: this measures enrolment
        DJANGO_SETTINGS_MODULE="config.settings",
        FADEN_LOG_LEVEL="WARNING",
    )
    import django

    django.setup()
    from django.core.management import call_command

    from console.models import Job
    from lab import DEFAULT_STATE_DIR
    from lab.harness import LabCommandError
    from machines import services
    from machines.models import Machine
    from tests.harness import console_lab

    call_command("migrate", verbosity=0)
    lab = console_lab(os.environ.get("FADEN_LAB_DIR", DEFAULT_STATE_DIR))
    try:
        if not args.keep_lab:
            lab.down()
            lab.up(args.spec)
    except LabCommandError as exc:
        sys.exit(str(exc))
    machines = lab.status()["machines"]
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "config", "worker", "-c", str(len(machines)), "-l", "WARNING", "-P", "threads"],
        cwd=ROOT,
    )
    try:
        from config.celery import app

        while not app.control.ping(timeout=0.5):  # the clock starts once the worker answers
            if worker.poll() is not None:
                sys.exit("the Celery worker did not start")

        def busy_seconds() -> tuple[float, float]:
            """CPU seconds used so far by the worker, and by the whole host (all its cores)."""
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            host = (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
            times = psutil.Process(worker.pid).cpu_times()
            return times.user + times.system, host

        def enrol_all(specs) -> tuple[float, list[tuple[str, float, str]]]:
            Machine.objects.all().delete()
            nonlocal cpu
            cpu_before = busy_seconds()
            started = time.monotonic()
            for spec in specs:
                services.machine_create(
                    name=spec["name"], address=spec["address"], ssh_port=spec["ssh_port"],
                    ssh_user=spec["ssh_user"], host_key_fingerprint=spec["host_key_fingerprint"],
                )
            while Job.objects.filter(state__in=["queued", "running"]).exists() or Machine.objects.filter(state="enrolling").exists():
                if time.monotonic() - started > 600:
                    sys.exit("enrolment did not finish within 10 minutes")
                time.sleep(0.05)
            wall = time.monotonic() - started
            cpu_after = busy_seconds()
            cpu = (cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1])
            rows = []
            for job in Job.objects.filter(kind="machine.enrol").order_by("title"):
                machine = Machine.objects.get(pk=job.target_id)
                rows.append((machine.name, (job.finished_at - job.started_at).total_seconds(), machine.state))
            return wall, rows

        cpu = (0.0, 0.0)
        one_wall, one_rows = enrol_all(machines[:1])
        one_cpu = cpu
        Job.objects.all().delete()
        all_wall, all_rows = enrol_all(machines)
        all_cpu = cpu
    finally:
        worker.terminate()
        worker.wait(timeout=30)
        if not args.keep_lab:
            lab.down()

    print(f"spec: {Path(args.spec).name}, {len(machines)} machines")
    cores = os.cpu_count()
    print(f"one machine alone: {one_wall:.2f} s wall ({one_rows[0][1]:.2f} s in its job); "
          f"CPU: console worker {one_cpu[0]:.2f} s, whole host {one_cpu[1]:.2f} s")
    for name, seconds, state in all_rows:
        print(f"  {name:<10} {seconds:6.2f} s  {state}")
    times = [s for _, s, _ in all_rows]
    print(
        f"all {len(machines)} at once: {all_wall:.2f} s wall; per machine median {statistics.median(times):.2f} s, "
        f"max {max(times):.2f} s; {all_wall / one_wall:.2f} x one machine"
    )
    print(
        f"CPU: console worker {all_cpu[0]:.2f} s, whole host {all_cpu[1]:.2f} s of {cores * all_wall:.2f} s available "
        f"({cores} cores): the lab's machines share this host's cores, so their side of the work "
        f"({all_cpu[1] - all_cpu[0]:.2f} s) runs {cores} at a time here, not all at once as on real machines"
    )
    failed = [name for name, _, state in all_rows if state != "healthy"]
    if failed:
        sys.exit(f"not healthy: {', '.join(failed)}")


if __name__ == "__main__":
    main()
