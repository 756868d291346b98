"""The lab hub as a host of its own on the management network, started by `up`.

It gets a network namespace (``fl-hub``) with a veth onto the management bridge (``flh-mgmt``),
address .250 there (``spec.HUB_HOST``), its link shaped both ways to the spec's ``[hub] rate_mbit``
as machines' links are to their networks' rates. In it runs ``python -m lab hub`` as a daemon,
logging to ``STATE/hub/hub.log``. The console (.1 on the bridge) and the machines (on the
management network) reach it at ``http://ADDRESS:PORT``; the namespace has no default route.

The gated model's token is made at `up` and written to ``STATE/hub/token`` (0600); the hub reads it
with ``--token-file``, so it is on no command line, and it is never printed. `down` ends the hub
with its namespace's processes, as it ends a machine's (``core.teardown``), and the sweep of
leftovers finds ``fl-hub`` and ``flh-*`` by name.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from . import netns
from .hub_models import MODELS, default_cache_dir
from .machine import _last_line
from .spec import LabSpec, MachineSpec
from .state import LabState
from .util import MACHINE_ENV, LabError, run

REPO = Path(__file__).resolve().parent.parent  # `python -m lab` runs the lab of this checkout
START_TIMEOUT = 20.0
# The lab's addresses are on this host: never through a proxy the caller's environment may name.
DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def hub_dir(state: LabState) -> Path:
    return state.root / "hub"


def create(state: LabState, spec: LabSpec) -> None:
    """The hub's namespace and its shaped link onto the management bridge."""
    hub, network = spec.hub, spec.management
    netns.create_netns(state, hub)
    # No IPv6 on its link (as on machines'): nothing but the hub's own answers on the bridge.
    run(["ip", "netns", "exec", hub.netns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
               "net.ipv6.conf.default.disable_ipv6=1"], check=False)
    netns.ip("link", "set", "lo", "up", netns=hub.netns)
    netns.create_link(state, hub.netns, hub.host_link(network.name), hub.temp_link(network.name),
                      network, spec.hub_address, hub.rate_mbit)
    netns.ip("link", "set", network.interface, "up", netns=hub.netns)


def start(state: LabState, spec: LabSpec) -> None:
    """Start the hub in its namespace (detached), with a new token; `wait_ready` waits for it."""
    directory = hub_dir(state)
    directory.mkdir(exist_ok=True)
    token_file = directory / "token"
    _write_token(token_file)
    command = ["nsenter", f"--net={netns.NETNS_DIR / spec.hub.netns}", sys.executable, "-m", "lab", "hub",
               "--bind", spec.hub_address, "--port", str(spec.hub.port), "--token-file", str(token_file)]
    # A clean environment, as for machines, but the same model cache `faden lab hub` would use here.
    env = {**MACHINE_ENV, "PYTHONPATH": str(REPO), "FADEN_LAB_CACHE": str(default_cache_dir().parent)}
    with open(directory / "hub.log", "a") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=REPO,
                                   env=env, start_new_session=True)
    process.returncode = 0  # it goes on alone: `down` ends it with its namespace
    state.data["hub"] = {"pid": process.pid, "token_file": str(token_file), "log": str(directory / "hub.log")}
    state.save()


def _write_token(path: Path) -> None:
    """A fresh token only root can read (a leftover of an earlier `up` is replaced)."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(f"hf_lab_{secrets.token_urlsafe(24)}\n")


def wait_ready(state: LabState, spec: LabSpec, timeout: float = START_TIMEOUT) -> list[str]:
    """Wait until the hub answers ``/api/models`` from the console's side; return the models it lists."""
    pid = state.data.get("hub", {}).get("pid")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with DIRECT.open(f"{spec.hub_url}/api/models", timeout=1) as response:
                return [model["id"] for model in json.loads(response.read())]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        alive = running(state, spec)
        if not alive or time.monotonic() > deadline:
            why = f"does not answer after {timeout:.0f}s" if alive else "exited"
            raise LabError(f"the lab hub (pid {pid}) {why} on {spec.hub_url}: {_last_line(hub_dir(state) / 'hub.log')}")
        time.sleep(0.05)


def running(state: LabState, spec: LabSpec) -> bool:
    """The hub `up` started is still a process of the hub's namespace."""
    pid = state.data.get("hub", {}).get("pid")
    return bool(pid) and pid in netns.netns_pids(spec.hub.netns)


def status(state: LabState, spec: LabSpec) -> dict:
    """The hub as `status --json` shows it (its token's file, never the token)."""
    record = state.data.get("hub", {})
    return {
        "url": spec.hub_url,
        "address": spec.hub_address,
        "port": spec.hub.port,
        "rate_mbit": spec.hub.rate_mbit,
        "netns": spec.hub.netns,
        "pid": record.get("pid"),
        "running": running(state, spec),
        "token_file": record.get("token_file"),
        "log": record.get("log"),
        "models": list(MODELS),
    }


def cut(spec: LabSpec, machine: MachineSpec) -> None:
    """The machine loses its route to the hub: connecting fails at once ("No route to host"),
    and every other address (the console's, the other machines') is reached as before."""
    netns.ip("route", "replace", "unreachable", f"{spec.hub_address}/32", netns=machine.netns)


def restore(spec: LabSpec, machine: MachineSpec) -> None:
    netns.ip("route", "del", "unreachable", f"{spec.hub_address}/32", netns=machine.netns, check=False)

