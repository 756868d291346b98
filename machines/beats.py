"""The runtime section of a heartbeat (agent 0.3, ``runtimebeat`` in the agent): read strictly, and
what it says is wrong, in words; and the GPUs' processes of a heartbeat or of facts (agent 0.9,
``gpuprocs``), down to those the console did not start. Pure: no models, no I/O.

``{"container": "running"|"exited"|"absent"|null, "ray": {"role": "head"|"worker"|null,
"alive": bool|null, "raylet": bool, "head_port_open": bool|null}}`` (docs/agent-protocol.md).
A beat is untrusted input: anything else in it reads as not known (null), never as a failure.
"""
from __future__ import annotations

CONTAINER_STATES = ("running", "exited", "absent")
ROLES = ("head", "worker")


def _flag(value) -> bool | None:
    return value if isinstance(value, bool) else None


def runtime_report(section) -> dict | None:
    """The section as the console keeps it, or None when the beat carries none (an older agent)."""
    if not isinstance(section, dict):
        return None
    ray = section.get("ray") if isinstance(section.get("ray"), dict) else {}
    container = section.get("container")
    role = ray.get("role")
    return {
        "container": container if container in CONTAINER_STATES else None,
        "ray": {"role": role if role in ROLES else None, "alive": _flag(ray.get("alive")),
                "raylet": ray.get("raylet") is True, "head_port_open": _flag(ray.get("head_port_open"))},
    }


def runtime_failure(report: dict | None) -> str:
    """What the report says is wrong ('' when nothing is): Ray that was started on the machine is
    gone, or the runtime's container is not running. A runtime not started, or Ray stopped on
    purpose, reports nulls: not a failure."""
    if not report:
        return ""
    container = report.get("container")
    ray = report.get("ray") or {}
    if container == "exited":
        return "the runtime container stopped"
    if container == "absent":
        return "the runtime container is gone"
    if ray.get("alive") is False:
        if not ray.get("raylet"):
            return "Ray is not running"
        if ray.get("head_port_open") is False:
            return "Ray's head port does not answer"
        return "Ray is not alive"
    return ""


MAX_GPU_PROCESSES = 64  # what the agent sends at most


def foreign_gpu_use(processes) -> dict[str, tuple[list[int], int | None]] | None:
    """The processes the console did not start, by GPU uuid: (their pids, sorted; the memory they hold in
    MiB, None when the tool said none). None when the list is absent (no nvidia-smi, an older agent, a beat
    that did not read it): the console then keeps what it has. Entries that are not a process are skipped."""
    if not isinstance(processes, list):
        return None
    pids: dict[str, set[int]] = {}
    memory: dict[str, int] = {}
    for entry in processes[:MAX_GPU_PROCESSES]:
        if not isinstance(entry, dict) or entry.get("console") is not False:
            continue  # the copies' own, or not known to be a person's
        uuid, pid, mib = entry.get("gpu_uuid"), entry.get("pid"), entry.get("used_memory_mib")
        if not isinstance(uuid, str) or not uuid or len(uuid) > 128 or type(pid) is not int or pid <= 0:
            continue
        pids.setdefault(uuid, set()).add(pid)
        if type(mib) is int and mib > 0:
            memory[uuid] = memory.get(uuid, 0) + mib
    return {uuid: (sorted(found), memory.get(uuid)) for uuid, found in pids.items()}
