#!/usr/bin/env python
"""Deploy → every copy Serving, for the lab's 512 MiB model on three lab machines, against the time to copy
its files to them.

    sudo .venv/bin/python bench/deploy.py
    sudo .venv/bin/python bench/deploy.py --machines 4 --fabric-mbit 800

It puts up a lab of its own (the server's link shaped to --server-mbit, the fabric to --fabric-mbit), enrols
the machines on the lab's `process` runtime, starts a cluster on them, imports
fadenstack-lab/medium-chat into the server's store, and times through the console's own services:

- deploy: "Deploy" of one copy of one GPU per machine, until every copy reads Serving (the model's files
  to the machines, the engines started, each answering its health endpoint and listing the model);
- copy: the same files to the same machines again, after they were removed ("Copy to <cluster>'s
  machines"), alone.

The difference is what a deployment adds to the copy: placing, starting the engines, waiting for them.
"""
import argparse
import sys
import time
from pathlib import Path

from distribute import console_env, lab_and_console, sh, write_spec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MiB = 1 << 20
MODEL = "fadenstack-lab/medium-chat"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--machines", type=int, default=3)
    parser.add_argument("--server-mbit", type=int, default=200)
    parser.add_argument("--fabric-mbit", type=int, default=400)
    args = parser.parse_args()

    data_dir, port = console_env(8792)
    from django.core.management import call_command

    from console.models import Job
    from deployments import services
    from deployments.choices import CopyState
    from deployments.forms import ask_from
    from deployments.models import Copy
    from deployments.store import downloads
    from deployments.store.services import model_copy, model_remove_from_machines
    from lab import hub_models
    from tests.harness import enrol, images_import, running

    call_command("migrate", verbosity=0)
    spec = data_dir / "spec.toml"
    write_spec(spec, args.machines, args.fabric_mbit)
    lab, web = lab_and_console(spec, port, args.server_mbit)
    try:
        names = sorted(lab.machines())
        lab.runtime("process", *names)
        images_import(lab)
        machines = enrol(lab, *names)
        cluster = running("bench", machines)
        store = hub_models.ModelStore(hub_models.default_cache_dir())
        plan = hub_models.MODELS[MODEL]
        store.files(plan)
        model = downloads.model_import(directory=store.model_dir(plan) / "files", repo=MODEL)

        ask = ask_from({"name": "bench", "copies": args.machines, "kind": "nvidia|H100 80GB|81559|x86_64",
                        "gpu_quarters": 4, "memory_per_gpu_gib": 8, "context_length": 2048}, cluster=cluster, model=model)
        started = time.monotonic()
        deployment = services.deployment_create(ask=ask)  # eager: the apply job runs here, to Serving
        deploy_seconds = time.monotonic() - started
        states = list(Copy.objects.filter(deployment=deployment).values_list("state", "state_reason"))
        if any(state != CopyState.SERVING for state, _ in states):
            sys.exit(f"not every copy serves: {states}")

        services.deployment_delete(deployment=deployment)
        model_remove_from_machines(model)
        started = time.monotonic()
        model_copy(model, cluster)
        copy_seconds = time.monotonic() - started
        job = Job.objects.filter(kind="model.copy").latest("created_at")
        if job.state != "succeeded":
            sys.exit(f"the copy failed: {job.error}")
    finally:
        sh("tc", "qdisc", "del", "dev", "flb-mgmt", "root", check=False)
        web.terminate()
        web.wait(timeout=30)
        lab.down()

    print(f"{MODEL}: {model.bytes_total / MiB:.0f} MiB; {args.machines} machines, one copy of 1 GPU on each; server link "
          f"{args.server_mbit} Mbit/s, fabric {args.fabric_mbit} Mbit/s")
    print(f"deploy → all Serving: {deploy_seconds:6.1f} s")
    print(f"copying the files:    {copy_seconds:6.1f} s")
    print(f"what the deployment adds (placing, starting the engines, waiting for them): {deploy_seconds - copy_seconds:.1f} s "
          f"({deploy_seconds / copy_seconds:.2f} x the copy)")


if __name__ == "__main__":
    main()
