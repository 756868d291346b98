#!/usr/bin/env python
"""Create -> Running for three lab machines on Podman with the real runtime image, the image not yet on
the machines and then already there; and the memory of each machine's runtime container with Ray idle.

    sudo .venv/bin/python bench/start.py [--runs 3]

It brings the lab up (a state directory of its own), starts a whole console in processes of its own
(Daphne, a Celery worker and beat) on a throwaway SQLite database and Redis database 6, enrols lab-a,
lab-b and lab-c on Podman, imports the lab's real builds, then for each run: clears the machines (no
image file, nothing loaded, Podman's images removed), creates a cluster and times it to Running ("cold");
stops and deletes it, creates it again and times it ("warm": the image is on the machines). The lab goes
down at the end.

    sudo .venv/bin/python bench/start.py --encrypted-vs-plain [--runs 3]

times warm starts only, each run one cluster encrypted (Ray's TLS and the copies' certificates: the steps
"Issue certificates" and Ray with RAY_USE_TLS, as every new cluster starts) and one plain (a cluster as one
started before encryption reads: no certificates, Ray without TLS), in alternating order, and prints what
encryption adds to create -> Running (issue 27's goal: at most 2 s). Both have the token and the firewall.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MACHINES = ("lab-a", "lab-b", "lab-c")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--encrypted-vs-plain", action="store_true",
                        help="warm starts only: encrypted against plain, alternating")
    args = parser.parse_args()

    data_dir = Path(tempfile.mkdtemp(prefix="fadenstack-bench-"))
    os.environ.update(FADEN_DATA_DIR=str(data_dir), FADEN_LAB_DIR=str(data_dir / "lab"),
                      DATABASE_URL=f"sqlite:///{data_dir}/bench.sqlite3",
                      REDIS_URL=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/6"),
                      DJANGO_SETTINGS_MODULE="config.settings", FADEN_CELERY_EAGER="0", FADEN_LOG_LEVEL="WARNING")
    import django

    django.setup()
    from django.core.management import call_command

    from clusters import services
    from clusters.choices import ClusterState
    from clusters.models import Cluster
    from tests.harness import all_up, console_lab, enrol, images_import, leave_nothing_running, running, wait_for
    from tests.processes import console_processes

    call_command("migrate", verbosity=0)
    lab = console_lab(data_dir / "lab")
    lab.up()
    cold, warm, memory = [], [], {}
    try:
        with console_processes(beat=True, enqueue=True):
            machines = enrol(lab, *MACHINES, timeout=120)
            images_import(lab, None, data_dir / "images")

            def timed(name: str) -> float:
                started = time.monotonic()
                running(name, machines, timeout=600)
                wait_for(lambda: all_up(name, len(MACHINES)), timeout=120, what=f"{name} with every machine Up")
                return time.monotonic() - started

            def gone(name: str) -> None:
                cluster = Cluster.objects.get(name=name)
                services.cluster_delete(cluster=cluster)
                wait_for(lambda: not Cluster.objects.filter(pk=cluster.pk).exists(), timeout=180, what=f"{name} to go")

            if args.encrypted_vs_plain:
                return encrypted_vs_plain(args.runs, timed, gone, Cluster)
            for run in range(args.runs):
                leave_nothing_running(machines)
                for machine in machines:  # not in Podman's storage either: a machine that never had it
                    lab.ssh(machine.address, "podman rmi -a -f >/dev/null 2>&1; true")
                cold.append(timed(f"cold-{run}"))
                if run == 0:
                    time.sleep(10)  # Ray settled and idle: what the memory figure is of
                    for machine in machines:
                        memory[machine.name] = lab.ssh(machine.address, "podman stats --no-stream --format "
                                                       "'{{.MemUsage}}'").stdout.strip()
                gone(f"cold-{run}")
                warm.append(timed(f"warm-{run}"))
                gone(f"warm-{run}")
                print(f"run {run + 1}: cold {cold[-1]:.1f} s, warm {warm[-1]:.1f} s", flush=True)
    finally:
        lab.run("down", check=False)
    print(f"create -> Running, 3 machines on Podman, {args.runs} runs: image not on the machines median "
          f"{statistics.median(cold):.1f} s (worst {max(cold):.1f}); already there median {statistics.median(warm):.1f} s "
          f"(worst {max(warm):.1f})")
    print("runtime container with Ray idle: " + ", ".join(f"{name} {used}" for name, used in memory.items()))
    assert Cluster.objects.filter(state=ClusterState.RUNNING).count() == 0


def encrypted_vs_plain(runs: int, timed, gone, cluster_model) -> None:
    """Warm create -> Running, encrypted and plain alternately (the first start of all, which puts the image
    on the machines, is not counted). A plain cluster is made by the model's defaults (its encryption off),
    as a cluster from before encryption reads."""
    fields = [cluster_model._meta.get_field(name) for name in ("ray_tls", "model_tls")]

    def start(name: str, encrypted: bool) -> float:
        for field in fields:
            field.default = encrypted
        try:
            return timed(name)
        finally:
            gone(name)

    start("warmup", True)
    seconds = {True: [], False: []}
    for run in range(runs):
        for encrypted in ((True, False) if run % 2 == 0 else (False, True)):
            seconds[encrypted].append(start(f"{'tls' if encrypted else 'plain'}-{run}", encrypted))
        print(f"run {run + 1}: encrypted {seconds[True][-1]:.1f} s, plain {seconds[False][-1]:.1f} s", flush=True)
    tls, plain = statistics.median(seconds[True]), statistics.median(seconds[False])
    print(f"create -> Running, 3 machines on Podman, image already there, {runs} runs each: encrypted median "
          f"{tls:.1f} s (worst {max(seconds[True]):.1f}), plain median {plain:.1f} s (worst {max(seconds[False]):.1f}); "
          f"encryption adds {tls - plain:+.1f} s (goal: at most 2 s)")


if __name__ == "__main__":
    main()
