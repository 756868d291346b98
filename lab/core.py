"""Bringing the lab up and down, and describing it (`status`)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

from . import DEFAULT_STATE_DIR, hub_host, netns
from . import machine as machines
from .spec import LabSpec, load_spec, parse_spec
from .state import LabState, host_locked, read_marker, remove_marker, write_marker
from .util import LabError, is_mount_point, missing_host_support, mount_points, run

KEY_PREFIXES = ("ssh-", "ecdsa-", "sk-")
DISK_SOURCE = "fadenstack-lab-disk"  # the tmpfs source name: how `down` finds a leftover disk


def read_authorized_key(argument: str | None) -> str | None:
    """The public key to authorise: a file (--authorized-key or the env), or the key itself."""
    value = argument or os.environ.get("FADEN_LAB_AUTHORIZED_KEY")
    if not value:
        return None
    if value.startswith(KEY_PREFIXES):
        key = value.strip()
    else:
        try:
            key = Path(value).expanduser().read_text().strip()
        except OSError as exc:
            raise LabError(f"authorized key {value}: {exc.strerror or exc}") from exc
    lines = [line for line in key.splitlines() if line.strip() and not line.startswith("#")]
    if not lines or not lines[0].startswith(KEY_PREFIXES) or len(lines[0].split()) < 2:
        raise LabError(f"authorized key {value}: not an OpenSSH public key line")
    return "\n".join(lines)


def spec_digest(raw: dict) -> str:
    payload = json.dumps(raw, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()


def loaded_spec(state: LabState) -> LabSpec:
    return parse_spec(state.data["spec"], source=state.data.get("spec_path", "<state>"))


def is_up(state: LabState) -> bool:
    """The state says up and every machine's namespace is still there."""
    if state.data.get("status") != "up" or _other_lab(state):
        return False
    return all(netns.netns_exists(name) for name in state.created("netns"))


def _other_lab(state: LabState) -> str | None:
    """The state dir of a lab from another state dir that holds this host, if any."""
    other = (read_marker() or {}).get("state_dir")
    if other and other != str(state.root) and Path(other, "state.json").exists():
        return other
    return None


def up(state: LabState, spec_path: str | None, key_argument: str | None) -> str:
    """Build the lab from a spec; return a one-line summary."""
    reason = missing_host_support()
    if reason:
        raise LabError(reason)
    spec = load_spec(spec_path)
    key = read_authorized_key(key_argument)
    digest = spec_digest(spec.raw)
    with host_locked(), state.locked(create=True):
        if state.data.get("status") == "up" and is_up(state):
            same_key = key is None or key == state.data.get("authorized_key")
            if state.data.get("digest") == digest and same_key:
                return f"lab is already up ({len(spec.machines)} machines, {state.root})"
            raise LabError("a lab with another spec or key is up: run `faden lab down` first")
        _refuse_other_lab(state)
        if state.data:
            # A stale state (host rebooted) or an `up` that died half way.
            teardown(state)
            state.data = {}
        started = time.monotonic()
        try:
            _build(state, spec, key, digest)
        except BaseException:
            with contextlib.suppress(Exception):
                teardown(state)
            raise
        seconds = time.monotonic() - started
    return (f"lab is up: {len(spec.machines)} machines on {len(spec.networks)} networks "
            f"in {seconds:.1f}s; console address {spec.console_address}; hub {spec.hub_url}; "
            f"state {state.root}")


def _owner_gone(root: str | Path) -> int | None:
    """The process id of the run that put up the lab in ``root`` when that run is gone (a test session
    or bench killed before its teardown), else None: a lab put up by hand has no owner and stays."""
    try:
        owner = int(json.loads(Path(root, "state.json").read_text()).get("owner_pid") or 0)
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return owner if owner > 0 and not Path(f"/proc/{owner}").exists() else None


def _refuse_other_lab(state: LabState) -> None:
    other = _other_lab(state)
    owner = _owner_gone(other) if other else None
    if owner:
        # Its run was killed before it could take its lab down: nobody can use that lab any more.
        with LabState(Path(other)).locked() as left:
            if left.data:
                teardown(left)
        print(f"took down the lab {other} left up by a run that is gone (pid {owner})", file=sys.stderr)
        other = _other_lab(state)
    if other:
        raise LabError(f"another lab is up (state dir {other}): run "
                           f"`FADEN_LAB_DIR={other} faden lab down` or `faden lab down --all` first")
    leftovers = netns.lab_netns_names() + [name for name in _lab_links() if name.startswith("flb-")]
    if leftovers:
        raise LabError(f"lab leftovers on this host ({', '.join(leftovers[:4])}): "
                       "run `faden lab down --all` first")


def _build(state: LabState, spec: LabSpec, key: str | None, digest: str) -> None:
    state.data = {
        "version": 1,
        "status": "starting",
        "spec_path": spec.source,
        "spec": spec.raw,
        "digest": digest,
        "authorized_key": key,
        "started": time.time(),
        # The run this lab belongs to (a test session, a bench): once it is gone, the next `up` may
        # take the lab down. Unset for a lab put up by hand.
        "owner_pid": int(os.environ.get("FADEN_LAB_OWNER_PID") or 0) or None,
        "created": {},
        "host": {
            "netns_dir_existed": netns.NETNS_DIR.exists(),
            "netns_dir_was_mounted": is_mount_point(netns.NETNS_DIR),
        },
        "machines": {},
    }
    state.save()
    write_marker(state.root)
    if key is None:
        key = _generate_lab_key(state)
    for mount_point in machines.HOST_MOUNT_POINTS:
        if not os.path.exists(mount_point):
            os.makedirs(mount_point)
            state.record("host_dirs", mount_point)
    for network in spec.networks:
        netns.create_bridge(state, network)
    hub_host.create(state, spec)
    for machine in spec.machines:
        netns.create_netns(state, machine)
        for name in machine.networks:
            netns.create_machine_link(state, spec, machine, spec.network(name))
    keygens = []
    for machine in spec.machines:
        machines.prepare_files(state, spec, machine, key)
        keygens.append((machine, machines.make_host_key(state, machine)))
        if machine.disk_mib:
            _mount_disk(state, machine)
    for machine, process in keygens:
        if process.wait() != 0:
            raise LabError(f"{machine.name}: ssh-keygen failed: {process.stderr.read().strip()}")
    for machine in spec.machines:
        state.machine(machine.name).update(powered=True, links_down=[], link_rates={},
                                           ports_taken={}, disk_full=False, hub_cut=False)
        machines.boot(state, machine)
    hub_host.start(state, spec)  # while the machines boot
    for machine in spec.machines:
        state.machine(machine.name)["init_pid"] = machines.wait_booted(state, spec, machine)
    hub_host.wait_ready(state, spec)
    state.data["status"] = "up"
    state.save()


def _generate_lab_key(state: LabState) -> str:
    """No key given: make one in the state dir so the lab is still usable by hand."""
    path = state.root / "lab_key"
    for stale in (path, path.with_suffix(".pub")):
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()
    run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "fadenstack-lab", "-f", str(path)])
    state.data["generated_key"] = str(path)
    state.save()
    return path.with_suffix(".pub").read_text().strip()


def _mount_disk(state: LabState, machine) -> None:
    # Mounted on the host (under the state dir) rather than in the machine, so
    # the disk keeps its files across a power cycle like a real one.
    path = machines.store_dir(state, machine)
    run(["mount", "-t", "tmpfs", "-o", f"size={machine.disk_mib}m,mode=0755", DISK_SOURCE,
         str(path)])
    state.record("mounts", str(path))


def down(state: LabState, everything: bool = False) -> str:
    """Remove everything this state dir's `up` made.

    With everything (`--all`), take down whatever lab this host holds: the
    one the marker names, wherever it was put up from, and any leftovers
    found by name (an interrupted run whose state dir is gone). Without it,
    another caller's lab is left alone: test sessions may share a host.
    """
    if not everything:
        if state.load():
            if os.geteuid() != 0:
                raise LabError("taking the lab down needs root")
            with host_locked(), state.locked():  # the order `up` takes them in
                if state.data:
                    teardown(state)
                    return "lab is down"
        marker = read_marker() or {}
        other = marker.get("state_dir")
        if other and other != str(state.root) and Path(other, "state.json").exists():
            return (f"lab is not up here ({state.root}); the lab up on this host is "
                    f"{other}'s: `FADEN_LAB_DIR={other} faden lab down` or `faden lab down --all`")
        return "lab is not up: nothing to do"
    if os.geteuid() != 0:
        raise LabError("taking the lab down needs root")
    taken_down = []
    with host_locked():
        marker = read_marker() or {}
        for root in dict.fromkeys([state.root, Path(marker.get("state_dir") or state.root)]):
            lab = LabState(root)
            with lab.locked():
                if lab.data:
                    teardown(lab)
                    taken_down.append(str(root))
        swept = sweep_leftovers()
    if not taken_down and not swept:
        return "lab is not up: nothing to do"
    message = f"lab is down ({', '.join(taken_down)})" if taken_down else "lab is down"
    if swept:
        message += f"; removed leftovers: {', '.join(swept[:6])}"
    return message


def teardown(state: LabState) -> None:
    """Processes first, then mounts, namespaces, links, bridges, files.

    A stale state (its lab died with a reboot) may name resources that another
    lab, put up since from another state dir, now holds: then only this state
    dir's own files and mounts go.
    """
    if os.geteuid() != 0:
        raise LabError("taking the lab down needs root")
    if _other_lab(state):
        for path in reversed(state.created("mounts")):
            if path.startswith(str(state.root) + "/"):
                _unmount(path)
        _remove_state_files(state)
        state.data = {}
        return
    namespaces = state.created("netns")
    for name in namespaces:
        netns.kill_netns_processes(name)
    for path in reversed(state.created("mounts")):
        _unmount(path)
    for name in namespaces:
        netns.delete_netns(name)
    for name in state.created("links"):
        netns.delete_link(name)
    for name in state.created("bridges"):
        netns.delete_link(name)
    for path in reversed(state.created("host_dirs")):
        with contextlib.suppress(OSError):
            os.rmdir(path)  # only when empty: someone may have put files there
    _restore_netns_dir(state.data.get("host", {}))
    _remove_state_files(state)
    remove_marker(state.root)
    state.data = {}


def _unmount(path: str) -> None:
    if is_mount_point(path):
        if run(["umount", path], check=False).returncode != 0:
            run(["umount", "-l", path], check=False)


def _restore_netns_dir(host: dict) -> None:
    directory = netns.NETNS_DIR
    if not directory.is_dir() or any(directory.iterdir()):
        return
    if not host.get("netns_dir_was_mounted", True) and is_mount_point(directory):
        run(["umount", str(directory)], check=False)
    if not host.get("netns_dir_existed", True):
        with contextlib.suppress(OSError):
            directory.rmdir()


def _remove_state_files(state: LabState) -> None:
    mounted = [path for path in mount_points() if path.startswith(str(state.root) + "/")]
    if mounted:
        raise LabError(f"still mounted, not removing the state dir: {mounted[0]}")
    for entry in state.root.iterdir() if state.root.is_dir() else []:
        if entry.name == ".lock":
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    if str(state.root) == DEFAULT_STATE_DIR:
        shutil.rmtree(state.root, ignore_errors=True)


def _lab_links() -> list[str]:
    pattern = re.compile(r"^(flb-[a-z0-9]+|f[lm](\d+|h)-[a-z0-9]+|fls-[a-z0-9]+)$")  # bridges; veths
    return sorted(name for name in os.listdir("/sys/class/net") if pattern.match(name))


def sweep_leftovers() -> list[str]:
    """Remove lab resources found by name that no state lists (an `up` whose state is gone)."""
    with open("/proc/self/mountinfo") as handle:
        disks = [line.split()[4] for line in handle if f" {DISK_SOURCE} " in line]
    namespaces = netns.lab_netns_names()
    links = _lab_links()
    for mount_point in machines.HOST_MOUNT_POINTS:
        with contextlib.suppress(OSError):
            os.rmdir(mount_point)  # the machines' mount points, when empty
    if not (disks or namespaces or links):
        return []
    if os.geteuid() != 0:
        raise LabError("taking the lab down needs root")
    for name in namespaces:
        netns.kill_netns_processes(name)
    for path in disks:
        _unmount(path)
    for name in namespaces:
        netns.delete_netns(name)
    for name in _lab_links():  # again: deleting a namespace takes its veth peers along
        netns.delete_link(name)
    # Whether `ip netns add` made /run/netns a mount is not known here; an
    # empty one serves nobody, and iproute2 makes it again when needed.
    _restore_netns_dir({"netns_dir_was_mounted": False})
    marker = read_marker()
    if marker and not Path(marker.get("state_dir") or "/nonexistent", "state.json").exists():
        remove_marker(Path(marker["state_dir"]))
    return disks + namespaces + links


def status(state: LabState) -> dict:
    """The lab as `status --json` prints it."""
    state.load()
    if not state.data or not is_up(state):
        result = {"up": False, "machines": [], "networks": [], "console_address": None}
        if state.data:
            result["stale"] = True
            result["state"] = state.data.get("status")
        return result
    spec = loaded_spec(state)
    result = {
        "up": True,
        "state_dir": str(state.root),
        "spec_path": state.data.get("spec_path"),
        "console_address": spec.console_address,
        "authorized_key": state.data.get("authorized_key"),
        "private_key": state.data.get("generated_key"),
        "networks": [network.to_json() for network in spec.networks],
        "hub": hub_host.status(state, spec),
        "machines": [],
    }
    for machine in spec.machines:
        record = state.data.get("machines", {}).get(machine.name, {})
        key = machines.host_key(state, machine.name)
        powered = record.get("powered", False)
        result["machines"].append({
            "name": machine.name,
            "address": spec.address(machine, spec.management.name),
            "ssh_port": 22,
            "ssh_user": "root",
            "host_key_fingerprint": machines.fingerprint(key),
            "host_key": key,
            "powered": powered,
            "sshd_running": bool(powered and machines.sshd_pid(state, machine.name)),
            "netns": machine.netns,
            "init_pid": record.get("init_pid") if powered else None,
            "spec": spec.machine_json(machine),
            "faults": {
                "links_down": record.get("links_down", []),
                "link_rates": record.get("link_rates", {}),
                "ports_taken": sorted(int(port) for port in record.get("ports_taken", {})),
                "disk_full": record.get("disk_full", False),
                "hub_cut": record.get("hub_cut", False),
            },
        })
    return result


def set_runtime(state: LabState, names: list[str], runtime: str) -> str:
    """Write the machines' agent config for ``runtime`` (what `faden lab runtime` does). The agent
    reads it at its next command; the console learns it at the machine's next Refresh facts."""
    with state.locked():
        known = state.data.get("machines", {})
        unknown = [name for name in names if name not in known]
        if unknown:
            raise LabError(f"no machine {', '.join(unknown)} in this lab (it has {', '.join(known) or 'none'})")
        spec = loaded_spec(state)
        for name in names:
            machines.write_agent_config(state, name, runtime, spec)
    return f"{', '.join(names)}: runtime {runtime}"
