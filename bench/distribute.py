#!/usr/bin/env python
"""The runtime image to N lab machines: the console's chain against the naive way.

    sudo .venv/bin/python bench/distribute.py              # 4 machines, the lab's real runtime image
    sudo .venv/bin/python bench/distribute.py --machines 6 --size-mib 128   # a synthetic image of 128 MiB

The server's own link is shaped to --server-mbit (the bridge's egress: every
byte the server sends goes through it), the fabric to --fabric-mbit per
machine. It enrols N machines, imports a lab build of the image, then times

- the chain: the console's distribution (one copy from the server, then machine
  to machine over the fabric, forwarded as it arrives);
- the naive way: every machine fetches its copy from the server.

For each it prints the time from the start to every machine verified, the
limit (one copy over the slowest link on the way plus the pipeline's fill:
one window per hop), their ratio, and the bytes the server sent.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MiB = 1 << 20


def sh(*argv: str, check: bool = True) -> str:
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if check and result.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed: {result.stderr.strip()}")
    return result.stdout


def console_env(port: int) -> tuple[Path, int]:
    """A console of the bench's own (a fresh data directory and SQLite, eager tasks) set up in this process."""
    data_dir = Path(tempfile.mkdtemp(prefix="fadenstack-bench-"))
    os.environ.update(
        FADEN_DATA_DIR=str(data_dir),
        DATABASE_URL=f"sqlite:///{data_dir}/bench.sqlite3",
        REDIS_URL=os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/15"),
        FADEN_CONSOLE_URL=f"http://198.18.0.1:{port}",
        FADEN_AGENT_TLS_URL=f"https://198.18.0.1:{port + 1}",  # the agents' TLS listener (lab_and_console)
        FADEN_CELERY_EAGER="1",
        DJANGO_SETTINGS_MODULE="config.settings",
        FADEN_LOG_LEVEL="WARNING",
    )
    import django

    django.setup()
    return data_dir, port


def lab_and_console(spec: Path, port: int, server_mbit: int):
    """The lab up from ``spec`` and Daphne on the bridge's address, the server's link shaped to ``server_mbit``."""
    from lab import DEFAULT_STATE_DIR
    from tests.harness import console_lab

    lab = console_lab(os.environ.get("FADEN_LAB_DIR", DEFAULT_STATE_DIR))
    lab.down()
    lab.up(spec)
    web = subprocess.Popen([sys.executable, "-m", "daphne", "-v", "0", "-b", "198.18.0.1", "-p", str(port), "config.asgi:application"],
                           cwd=ROOT, stderr=subprocess.DEVNULL)
    # The machines fetch the first copy over TLS to the pinned certificate, from the agents' listener as faden serve runs it.
    from console.management.commands.serve import agents_argv

    web.agents = subprocess.Popen(agents_argv(sys.executable, bind="198.18.0.1", port=port + 1), cwd=ROOT,
                                  stderr=subprocess.DEVNULL)
    # The server's link: everything the console sends to the machines leaves through the bridge.
    sh("tc", "qdisc", "replace", "dev", "flb-mgmt", "root", "tbf", "rate", f"{server_mbit}mbit",
       "burst", "256kb", "latency", "100ms")
    return lab, web


def write_spec(path: Path, machines: int, fabric_mbit: int, hub_mbit: int | None = None) -> None:
    lines = [
        '[[networks]]\nname = "mgmt"\nsubnet = "198.18.0.0/24"\ninterface = "eth0"\nrate_mbit = 1000\nmanagement = true\n',
        f'[[networks]]\nname = "fabric"\nsubnet = "198.18.1.0/24"\ninterface = "eth1"\nrate_mbit = {fabric_mbit}\n',
        '[defaults]\narch = "x86_64"\nnetworks = ["mgmt", "fabric"]\n'
        'accelerators = [{ vendor = "nvidia", model = "NVIDIA H100 80GB HBM3", count = 8, memory_mib = 81559 }]\n',
    ]
    lines += [f'[[machines]]\nname = "lab-{i:02d}"\n' for i in range(1, machines + 1)]
    if hub_mbit:
        lines.append(f"[hub]\nrate_mbit = {hub_mbit}\n")
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machines", type=int, default=4)
    parser.add_argument("--size-mib", type=int, default=None,
                        help="a synthetic image of this size instead of the real one (Debian + Ray)")
    parser.add_argument("--server-mbit", type=int, default=200)
    parser.add_argument("--fabric-mbit", type=int, default=400)
    args = parser.parse_args()

    data_dir, port = console_env(8790)
    from django.core.management import call_command

    from clusters import images
    from clusters.fanout import ProgressBoard
    from clusters.models import Cluster, ClusterMember, Transfer
    from clusters.transfer import distribute
    from console import agent_tls
    from console.jobs import JobContext, job_create
    from machines import remote
    from machines.agent_client import Agent, FileSource, FileSpec
    from machines.services import machine_target
    from tests.harness import enrol

    call_command("migrate", verbosity=0)
    spec = data_dir / "spec.toml"
    write_spec(spec, args.machines, args.fabric_mbit)
    lab, web = lab_and_console(spec, port, args.server_mbit)
    try:
        machines = enrol(lab, *sorted(lab.machines()))
        image_path = lab.images(args.size_mib, data_dir / "images")[0]
        image = images.runtime_image_import(path=image_path)
        cluster = Cluster.objects.create(name="bench", network="198.18.1.0/24")
        for i, m in enumerate(machines):
            ClusterMember.objects.create(cluster=cluster, machine=m, role="head" if i == 0 else "worker",
                                         address=m.address.replace("198.18.0.", "198.18.1."), runtime_image=image)

        def clear_stores() -> None:
            for m in machines:
                with remote.connect(machine_target(m)) as conn:
                    remote.run(conn, ["rm", "-rf", "/var/lib/fadenstack/blobs", "/var/lib/fadenstack/images"])
            Transfer.objects.all().delete()

        # The chain, as a cluster start does it.
        clear_stores()
        job = job_create(kind="bench", title="bench", target_type="cluster", target_id=cluster.pk, steps=["image"])
        ctx = JobContext(job, on_change=lambda j: None)
        fresh = list(ClusterMember.objects.filter(cluster=cluster).select_related("machine", "runtime_image").order_by("machine__name"))
        started = time.monotonic()
        with ProgressBoard(cluster) as board:
            distribute(ctx, cluster, fresh, fresh[0], board, images.runtime_files)
        chain_seconds = time.monotonic() - started
        fetched = {t.member.machine.name: t.bytes_fetched for t in Transfer.objects.select_related("member__machine")}
        chain_server_bytes = fetched[machines[0].name]

        # The naive way: every machine from the server.
        clear_stores()
        spec = FileSpec(digest=image.digest, size=image.size_bytes, chunk_size=image.chunk_size, chunk_hashes=image.chunk_hashes)
        source_url = f"https://198.18.0.1:{port + 1}/agent/images/{image.digest}/"  # as the console gives it

        def naive_fetch(machine) -> int:
            grant = images.ImageGrant(digest=image.digest, cluster_id=cluster.pk, machine_id=machine.pk)
            token = images.image_download_token(grant=grant, lifetime=3600)
            with Agent.open(machine) as agent:
                return agent.file_fetch(spec, FileSource(url=source_url, token=token, pin=agent_tls.pin()), timeout=3600)

        started = time.monotonic()
        with ThreadPoolExecutor(len(machines)) as pool:
            naive_server_bytes = sum(pool.map(naive_fetch, machines))
        naive_seconds = time.monotonic() - started
    finally:
        sh("tc", "qdisc", "del", "dev", "flb-mgmt", "root", check=False)
        for process in (web, web.agents):
            process.terminate()
            process.wait(timeout=30)
        lab.down()

    size = image.size_bytes
    bits = size * 8 / 1e6  # megabits in one copy
    fill = (args.machines - 1) * starting_window(image.chunk_size) * 8 / 1e6 / args.fabric_mbit
    chain_limit = bits / min(args.server_mbit, args.fabric_mbit) + fill
    naive_limit = bits * args.machines / args.server_mbit
    print(f"{args.machines} machines, image {size / MiB:.0f} MiB, server link {args.server_mbit} Mbit/s, "
          f"fabric {args.fabric_mbit} Mbit/s")
    print(f"chain: {chain_seconds:6.1f} s to every machine verified; limit {chain_limit:.1f} s "
          f"(one copy {bits / min(args.server_mbit, args.fabric_mbit):.1f} s + fill {fill:.1f} s); "
          f"ratio {chain_seconds / chain_limit:.2f}; server sent {chain_server_bytes / MiB:.0f} MiB "
          f"({chain_server_bytes / size:.2f} copies)")
    print(f"naive: {naive_seconds:6.1f} s to every machine verified; limit {naive_limit:.1f} s; "
          f"ratio {naive_seconds / naive_limit:.2f}; server sent {naive_server_bytes / MiB:.0f} MiB "
          f"({naive_server_bytes / size:.2f} copies)")


def starting_window(chunk_size: int) -> int:
    """What a machine must hold before the next can start: one verified chunk."""
    return chunk_size


if __name__ == "__main__":
    main()
