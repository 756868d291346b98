"""What an engine no record knows tells of itself, read from what its machine's agent reports (``copy list``):
its command line (the console built it: ``deployments/engine.py``), its port and address, the GPUs its
environment shows it, and when it started. Pure: plain dicts in, plain data out; the database is asked in
``deployments/orphans.py``.

An engine is *keepable* (it can become a deployment again, as it runs) only when everything a deployment
records can be read from it: the model's directory, the name it serves, the GPUs it holds, its share of their
memory and its context length. When one of them cannot be read, only *delete it properly* is offered, and the
refusal says which is missing and why.
"""
from __future__ import annotations

import re
from collections import defaultdict
from datetime import datetime, timezone

from deployments.engine import API_KEY_ENV

COPY_KEY_RE = re.compile(r"^d(?P<deployment>\d+)-c(?P<number>\d+)$")  # Copy.key of a copy the console placed
RAY_NODE_SUFFIX = "-ray"  # copy_procs.NODE_SUFFIX: a spanning copy's Ray node, a piece of its engine's copy


def flag(argv, name: str) -> str | None:
    """The value of ``--name value`` or ``--name=value`` on the command line, or None."""
    argv = list(argv)
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            return argv[i + 1]
        if word.startswith(name + "="):
            return word[len(name) + 1:]
    return None


def is_ray_node(key: str) -> bool:
    return key.endswith(RAY_NODE_SUFFIX)


def engine_entry(status, *, machine_id: int, machine_name: str) -> dict:
    """One engine as the look keeps it (JSON): where it runs and what it says of itself."""
    since = (datetime.fromtimestamp(status.started_at, tz=timezone.utc).isoformat()
             if status.started_at is not None else None)
    argv = list(status.argv)
    return {"machine": machine_id, "machine_name": machine_name, "copy": status.copy, "cluster": status.cluster,
            "pid": status.pid,
            "port": status.port, "address": status.address, "since": since, "running": status.running,
            "healthy": status.healthy, "gpus": list(status.gpus) if status.gpus is not None else None,
            "argv": argv, "env_names": list(status.env_names), "name": served_name(argv, status.copy),
            "model_dir": argv[2] if len(argv) > 2 and argv[1] == "serve" else None, "nodes": []}


def served_name(argv, key: str) -> str:
    """The name the engine answers under (``--served-model-name``), else its id on the machine."""
    return flag(argv, "--served-model-name") or key


def grouped(engines: list[dict]) -> dict[str, list[dict]]:
    """Engines by the name they serve: the copies of one model, as the gateway would route them."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for engine in engines:
        groups[engine["name"]].append(engine)
    return dict(sorted(groups.items()))


def gpu_quarters(gpus: int, memory_fraction: float) -> int:
    """A deployment's GPUs per copy, in quarters: a copy on one GPU that uses at most a quarter (a half) of its
    memory held a quarter (a half) of it when it was placed; any other holds its GPUs whole."""
    if gpus == 1 and memory_fraction <= 0.25:
        return 1
    if gpus == 1 and memory_fraction <= 0.5:
        return 2
    return 4 * gpus


def shape(engines: list[dict]) -> tuple[dict | None, str | None]:
    """What a deployment of these engines would record, or None with why it cannot be read from them."""
    first = engines[0]
    where = f"on {first['machine_name']}"
    if any(e["nodes"] for e in engines) or any(int(flag(e["argv"], "--pipeline-parallel-size") or 1) > 1 for e in engines):
        return None, (f"It runs over several machines {where} and others, and the console cannot tell which GPUs of "
                      "each it holds.")
    if any(API_KEY_ENV in e["env_names"] for e in engines):
        return None, ("It asks every caller for its own key, which the console no longer holds, so the gateway could "
                      "not call it.")
    if any(e["gpus"] is None for e in engines):
        return None, (f"Its machine does not say which GPUs it runs on (its agent started it before agents said so) "
                      f"{where}.")
    if any(not e["model_dir"] for e in engines):
        return None, f"Its command line names no model {where}."
    if any(not e["running"] for e in engines):
        stopped = next(e for e in engines if not e["running"])
        return None, f"Its engine on {stopped['machine_name']} is not running."
    try:
        fraction = float(flag(first["argv"], "--gpu-memory-utilization") or "")
        context = int(flag(first["argv"], "--max-model-len") or "")
    except ValueError:
        return None, f"Its command line does not say its share of GPU memory and its context length {where}."
    if not 0 < fraction <= 1 or context < 16:
        return None, f"Its command line gives a share of GPU memory or a context length the console does not use {where}."
    facts = {(e["model_dir"], len(e["gpus"]), flag(e["argv"], "--gpu-memory-utilization"),
              flag(e["argv"], "--max-model-len")) for e in engines}
    if len(facts) > 1:
        return None, "Its engines do not all run the same model the same way, so they cannot be one deployment."
    if not first["gpus"] or not first["port"]:
        return None, f"Its machine does not say its GPUs and port {where}."
    return {"model_dir": first["model_dir"], "gpus": len(first["gpus"]), "memory_fraction": fraction,
            "context_length": context, "gpu_quarters": gpu_quarters(len(first["gpus"]), fraction),
            "tls": flag(first["argv"], "--ssl-certfile") is not None}, None
