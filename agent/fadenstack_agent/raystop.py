"""Stopping this machine's Ray, for ``ray stop`` and ``runtime stop``: its
processes (``rayproc.ray_processes``) in Ray's order, each told first (SIGTERM)
and forced (SIGKILL) only when it does not go.
"""

import os
import signal
import socket
import time

from .rayargs import GCS_PROBE_TIMEOUT, STOP_GRACE, UNREACHABLE_GRACE, temp_dir
from .rayproc import ray_lock, ray_processes, ray_view, read_proc, read_record, write_record

DASHBOARD_HEAD = "/ray/dashboard/dashboard.py"


def _still_there(proc) -> bool:
    now = read_proc(proc.pid)
    return now is not None and now.start == proc.start


def is_dashboard_head(proc) -> bool:
    return any(arg.endswith(DASHBOARD_HEAD) for arg in proc.argv[1:3])


def gcs_answers(procs: list, timeout: float = GCS_PROBE_TIMEOUT) -> bool:
    """Whether the GCS these processes belong to (their raylet's ``--gcs-address``,
    or a GCS server among them) accepts a TCP connection now."""
    for proc in procs:
        if os.path.basename(proc.argv[0]) == "gcs_server":
            return True
    for proc in procs:
        address = proc.flag("--gcs-address") if os.path.basename(proc.argv[0]) == "raylet" else None
        if address:
            host, _, port = address.rpartition(":")
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
                    return True
            except (OSError, ValueError):
                return False
    return True


def terminate(procs: list, grace: float = STOP_GRACE):
    """Stop processes in Ray's order; returns (stopped pids, forced pids).

    The raylet first (SIGTERM): it unregisters from the GCS, so the cluster
    learns at once that the node is gone, and takes its workers and agents
    along; that needs a live GCS (with the GCS terminated alongside it, the
    raylet hangs).  Then SIGTERM to the rest but the GCS server, whose
    clients (the autoscaler's monitor, the dashboard) report their end to it
    and hang on their way out when it has gone first; then the GCS server.
    Each wave waits at most ``grace`` s; SIGKILL to what still runs after
    them.  A raylet still there after its wave waits for the GCS in vain: it
    gets SIGKILL at once.  When the GCS does not answer at all (the head's
    Ray was killed, the network to it is down), nothing can end cleanly by
    telling it, so every wave waits only ``UNREACHABLE_GRACE`` s.  Ray's
    dashboard head gets SIGKILL with its wave: its SIGTERM handler exits
    without any cleanup (``os._exit``, ray/dashboard/dashboard.py), but only
    once its event loop runs it, seconds later.
    """
    live = [p for p in procs if _still_there(p)]
    if not gcs_answers(live):
        grace = min(grace, UNREACHABLE_GRACE)
    raylets = [p for p in live if os.path.basename(p.argv[0]) == "raylet"]
    gcs = [p for p in live if os.path.basename(p.argv[0]) == "gcs_server"]
    rest = [p for p in live if p not in raylets and p not in gcs]
    forced = []
    for wave in (raylets, rest, gcs):
        if wave is not raylets:  # a raylet past its own wave waits for the GCS in vain
            forced += _kill([p for p in raylets if p not in forced])
        wave = [p for p in wave if _still_there(p)]
        forced += _kill([p for p in wave if is_dashboard_head(p)])
        for proc in wave:
            if proc not in forced:
                signal_quietly(proc.pid, signal.SIGTERM)
        _wait_gone(wave, grace)
    forced += _kill(live)
    _wait_gone(forced, 5)
    return [p.pid for p in live], [p.pid for p in forced]


def _kill(procs: list) -> list:
    """SIGKILL to those of ``procs`` still there; those."""
    there = [p for p in procs if _still_there(p)]
    for proc in there:
        signal_quietly(proc.pid, signal.SIGKILL)
    return there


def _wait_gone(procs: list, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_still_there(p) for p in procs):
        time.sleep(0.02)


def signal_quietly(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_processes(store: str, out=None, driver=None) -> dict:
    """Stop this machine's Ray (under ``<store>/ray``; in the runtime container
    with a container ``driver``); the caller holds the lock."""
    started = time.monotonic()
    record = read_record(store)
    stopped, forced = [], []
    for _ in range(3):          # workers may be forked while the rest goes down
        temp, procs = ray_view(store, driver)
        procs = ray_processes(temp, record.get("sids", ()), procs)
        if not procs:
            break
        if out is not None:
            out.log("stopping %d Ray process(es): %s" % (len(procs), ", ".join(str(p.pid) for p in procs)))
        done, killed = terminate(procs)
        stopped += done
        forced += killed
    try:
        os.unlink(os.path.join(temp_dir(store), "ray_current_cluster"))
    except OSError:
        pass
    if record:
        write_record(store, role=None, sids=[], stopped_at=round(time.time(), 3))
    return {"stopped": bool(stopped), "pids": sorted(set(stopped)), "forced": sorted(set(forced)),
            "seconds": round(time.monotonic() - started, 3)}


def stop_locked(store: str, out=None, driver=None) -> dict:
    with ray_lock(store):
        return stop_processes(store, out, driver)
