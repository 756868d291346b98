#!/usr/bin/env python
"""The lab's 512 MiB model: the server's own download from the lab hub, then to N lab machines.

    sudo .venv/bin/python bench/models.py                  # 4 machines
    sudo .venv/bin/python bench/models.py --machines 6 --hub-mbit 800

The hub's link is shaped to --hub-mbit (the lab hub is a host of its own), the server's link to the
machines to --server-mbit (the bridge's egress), the fabric to --fabric-mbit per machine. It enrols N
machines and times, through the console's own services:

- the download: the server's store gets fadenstack-lab/medium-chat from the hub (huggingface_hub for
  the listing and the URLs, every file checked against the hub's digest), against one copy over the
  hub's link;
- the copy: "Copy to <cluster>'s machines" with Server copies (one copy from the server, then machine
  to machine over the fabric, forwarded as it arrives), against the limit: one copy over the slowest
  link on the way plus the pipeline's fill (one chunk per hop). Goal: at most 1.3 times the limit,
  and the server sends one copy.
"""
import argparse
import sys
import time
from pathlib import Path

from distribute import console_env, lab_and_console, sh, starting_window, write_spec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MiB = 1 << 20
MODEL = "fadenstack-lab/medium-chat"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machines", type=int, default=4)
    parser.add_argument("--hub-mbit", type=int, default=400)
    parser.add_argument("--server-mbit", type=int, default=200)
    parser.add_argument("--fabric-mbit", type=int, default=400)
    args = parser.parse_args()

    data_dir, port = console_env(8791)
    from django.conf import settings
    from django.core.management import call_command

    from clusters.choices import ClusterState
    from clusters.models import Cluster, ClusterMember, Transfer
    from console.models import Job
    from deployments.store import services
    from tests.harness import enrol

    call_command("migrate", verbosity=0)
    spec = data_dir / "spec.toml"
    write_spec(spec, args.machines, args.fabric_mbit, hub_mbit=args.hub_mbit)
    lab, web = lab_and_console(spec, port, args.server_mbit)
    settings.FADEN_HF_ENDPOINT = lab.status()["hub"]["url"]
    try:
        machines = enrol(lab, *sorted(lab.machines()))
        started = time.monotonic()
        model = services.model_add(repo=MODEL)  # eager: the download runs here
        download_seconds = time.monotonic() - started
        model.refresh_from_db()
        if model.state != "ready":
            sys.exit(f"the download failed: {model.state_reason}")

        cluster = Cluster.objects.create(name="bench", network="198.18.1.0/24", state=ClusterState.STOPPED)
        for i, m in enumerate(machines):
            ClusterMember.objects.create(cluster=cluster, machine=m, role="head" if i == 0 else "worker", state="stopped",
                                         address=m.address.replace("198.18.0.", "198.18.1."))
        started = time.monotonic()
        services.model_copy(model, cluster)
        copy_seconds = time.monotonic() - started
        job = Job.objects.get(kind="model.copy")
        if job.state != "succeeded":
            sys.exit(f"the copy failed: {job.error}")
        server_bytes = sum(Transfer.objects.filter(source="the server").values_list("bytes_fetched", flat=True))
        chunk = max(model.files.values_list("chunk_size", flat=True))
    finally:
        sh("tc", "qdisc", "del", "dev", "flb-mgmt", "root", check=False)
        web.terminate()
        web.wait(timeout=30)
        lab.down()

    size = model.bytes_total
    bits = size * 8 / 1e6
    download_limit = bits / args.hub_mbit
    fill = (args.machines - 1) * starting_window(chunk) * 8 / 1e6 / args.fabric_mbit
    copy_limit = bits / min(args.server_mbit, args.fabric_mbit) + fill
    print(f"{MODEL}: {size / MiB:.0f} MiB in {model.files.count()} files; hub link {args.hub_mbit} Mbit/s, "
          f"server link {args.server_mbit} Mbit/s, fabric {args.fabric_mbit} Mbit/s, {args.machines} machines")
    print(f"download: {download_seconds:6.1f} s into the server's store, checked; one copy over the hub's link "
          f"{download_limit:.1f} s; ratio {download_seconds / download_limit:.2f}")
    print(f"copy:     {copy_seconds:6.1f} s to every machine placed; limit {copy_limit:.1f} s (one copy "
          f"{bits / min(args.server_mbit, args.fabric_mbit):.1f} s + fill {fill:.1f} s); ratio {copy_seconds / copy_limit:.2f} "
          f"(goal 1.30); server sent {server_bytes / MiB:.0f} MiB ({server_bytes / size:.2f} copies)")


if __name__ == "__main__":
    main()
