"""The lab from the console's side, shared by the lab tests and the benchmarks: the lab put up with
the console's key, machines enrolled over SSH, the lab's runtime images imported, clusters started,
machines left with nothing running, and waiting on the database (the truth the pages show).

The lab itself (up, down, status, faults, images) is lab/harness.py; this adds what needs the server.
Django must be set up before these functions are called (pytest-django does; a bench calls django.setup()).
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from lab.harness import Lab, wait_until

LAB_CONSOLE_ADDRESS = "198.18.0.1"  # the console as the lab's machines see it (the bridges' address)
FABRIC = "198.18.1.0/24"
IMAGE_MIB = 48  # big enough to cut in the middle, small enough for CI
# Every interval shortened, so that a minute of the product is seconds here.
INTERVALS = {
    "FADEN_HEALTH_INTERVAL": "4",
    "FADEN_HEALTH_LOOK_AGAIN": "2",
    "FADEN_RESTART_PAUSE": "1",  # then 2 s before the third restart
    "FADEN_FAILED_RETRY": "3600",  # the test powers the head on instead of waiting for the 15-minute retry
    "FADEN_RETRY_TICK": "2",
    "FADEN_JOB_BEAT": "1",
    "FADEN_JOB_STALE": "5",  # five beats missed: a worker killed is replaced within seconds
    "FADEN_JOB_REAP_TICK": "2",
    "FADEN_HEARTBEAT_INTERVAL": "2",
    "FADEN_OFFLINE_AFTER": "6",  # three beats missed, as the modules without beat of their own use
    "FADEN_OFFLINE_TICK": "2",
    "FADEN_SSH_CONNECT_TIMEOUT": "5",  # a powered-off machine is given up on in 5 s, not 10
    "FADEN_GATEWAY_USAGE_TICK": "2",  # the keys' usage copied from Redis to the database
}

T = TypeVar("T")


def console_lab(state_dir: str | Path | None = None) -> Lab:
    """The lab object for a lab whose machines let the console's key in (made now if it is not there yet)."""
    from machines.remote import console_key_path, console_public_key

    console_public_key()
    return Lab(state_dir, key=console_key_path())


def wait_for(condition: Callable[[], T], *, timeout: float, what: str, every: float = 0.5) -> T:
    """Poll the database until ``condition`` holds and return its value; the failure tells what the
    clusters, their members and the latest jobs were meanwhile. With FADEN_TEST_WAITS set, each wait's
    length goes to stderr (run with -s to see where a lab test spends its time)."""
    started = time.monotonic()
    try:
        return wait_until(condition, timeout=timeout, what=what, every=every, meanwhile=what_happened)
    finally:
        if os.environ.get("FADEN_TEST_WAITS"):
            print(f"waited {time.monotonic() - started:6.1f} s for {what}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def phase(name: str):
    """A part of a long lab test; with FADEN_TEST_WAITS set its length goes to stderr, as the waits' do."""
    started = time.monotonic()
    try:
        yield
    finally:
        if os.environ.get("FADEN_TEST_WAITS"):
            print(f"phase  {time.monotonic() - started:6.1f} s: {name}", file=sys.stderr, flush=True)


def what_happened() -> str:
    from clusters.models import Cluster
    from console.models import Job
    from machines.models import Machine

    lines = [f"machine {m.name}: {m.state} {m.state_reason!r}" for m in Machine.objects.order_by("name")]
    for cluster in Cluster.objects.all():
        lines.append(f"{cluster.name}: {cluster.state} {cluster.state_reason!r}")
        lines += [f"  {m.machine.name}: {m.state} {m.state_reason!r}" for m in cluster.members.select_related("machine")]
        lines += [f"  check {c.outcome}: {c.action}" for c in cluster.health_checks.all()[:5]]
    for job in Job.objects.order_by("-pk")[:6]:
        lines.append(f"job {job.kind} {job.title} {job.state} {job.error!r} steps={[s['state'] for s in job.steps]}\n{job.log[-800:]}")
    return "\n".join(lines)


# -- machines -------------------------------------------------------------------------------------

def enrol(lab: Lab, *names: str, timeout: float = 60) -> list:
    """Enrol the named lab machines over SSH (eagerly, or through a worker) and wait until each reads Healthy."""
    from machines.choices import MachineState
    from machines.models import Machine
    from machines.services import machine_create

    status = lab.machines()
    for name in names:
        machine_create(name=name, address=status[name]["address"], ssh_port=status[name]["ssh_port"],
                       ssh_user=status[name]["ssh_user"], host_key_fingerprint=status[name]["host_key_fingerprint"])

    def healthy(name: str):
        machine = Machine.objects.get(name=name)
        assert machine.state != MachineState.FAILED, f"{name} did not enrol: {machine.state_reason}"
        return machine if machine.state == MachineState.HEALTHY else None

    return [wait_for(lambda n=n: healthy(n), timeout=timeout, what=f"{n} to enrol") for n in names]


def images_import(lab: Lab, size_mib: int | None = IMAGE_MIB, out: str | Path | None = None) -> list:
    """The lab's runtime image builds (x86_64 and aarch64 NVIDIA; none for AMD), imported into the console:
    synthetic ones of ``size_mib`` for the `process` runtime, the real ones (Debian + Ray) with None."""
    from clusters import images

    return [images.runtime_image_import(path=path) for path in lab.images(size_mib, out)]


def leave_nothing_running(machines: Iterable) -> None:
    """Every machine at once: Ray and the runtime stopped, no file server, no image or runtime in its store.
    Machines that do not answer (powered off) are skipped."""
    from django.db import connections

    from machines import remote
    from machines.agent_client import Agent, AgentError
    from machines.services import machine_target

    def clear(machine) -> None:
        try:
            with Agent.open(machine) as agent:
                agent.runtime_stop()
                agent.serve_stop()
            with remote.connect(machine_target(machine)) as conn:
                remote.run(conn, ["rm", "-rf", "/var/lib/fadenstack/blobs", "/var/lib/fadenstack/images", "/var/lib/fadenstack/runtime"])
        except (AgentError, remote.RemoteError):
            pass
        finally:
            connections.close_all()

    machines = list(machines)
    with ThreadPoolExecutor(max(1, len(machines))) as pool:
        list(pool.map(clear, machines))


def ray_runs_on(machine) -> bool:
    from machines.agent_client import Agent

    with Agent.open(machine) as agent:
        return agent.runtime_status().raw["ray"]["running"]


# -- clusters -------------------------------------------------------------------------------------

def cluster_in(name: str, *states: str):
    from clusters.models import Cluster

    cluster = Cluster.objects.filter(name=name).first()
    return cluster if cluster and cluster.state in states else None


def running(name: str, machines, timeout: float = 180):
    """Create a cluster of ``machines`` (the first leads) on the fabric and wait until it runs."""
    from clusters import services
    from clusters.choices import ClusterState

    services.cluster_create(name=name, machine_ids=[m.pk for m in machines], head_id=machines[0].pk, network=FABRIC)
    return wait_for(lambda: cluster_in(name, ClusterState.RUNNING), timeout=timeout, what=f"{name} to run")


def all_up(name: str, count: int | None = None):
    """The cluster, when it runs with every member (``count`` of them, if given) Up and nothing to say."""
    from clusters.choices import ClusterState, MemberState

    cluster = cluster_in(name, ClusterState.RUNNING)
    if cluster is None or cluster.state_reason:
        return None
    members = cluster.members.all()
    joined = members.filter(state=MemberState.JOINED).count()
    return cluster if joined == (members.count() if count is None else count) and joined else None
