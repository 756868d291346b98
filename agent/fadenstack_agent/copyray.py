"""A copy that spans machines: a Ray of its own, one node per machine of the copy.

vLLM runs a copy over several machines through Ray (tensor parallel within a
machine, pipeline parallel across them).  The copy does not use the cluster's
Ray: that one offers every GPU of its machines to anything that asks, while a
copy must run on exactly the GPUs the console's placement gave it.  So each
spanning copy gets a Ray of its own: a node on each of its machines, started
with only the copy's GPUs visible (``CUDA_VISIBLE_DEVICES`` or its AMD
counterparts: Ray takes its GPU ids from them) and ``--num-gpus`` their
number, in a temp dir of its own.  The engine on the first machine joins it
(``RAY_ADDRESS``) and Ray hands its workers those GPUs and no others.

A node is a ``copy start`` whose spec has ``ray`` instead of ``argv``::

    {"copy": "d7-c3-ray", "cluster": "gpu-room", "address": "198.18.1.11",
     "ray": {"head": null, "gpus": 2}, "env": {"CUDA_VISIBLE_DEVICES": "2,3"}}

``head`` null starts the copy's Ray head (its GCS on a free port of the
address, reported as ``port``), ``"198.18.1.11:41234"`` a node joining it.
The node is ``ray start --block``: one process whose session holds Ray's own,
recorded, listed and stopped like an engine (``copyproc``).  Its ports are
Ray's choice but the head's GCS, its client server and the dashboard agent's,
which default to fixed numbers the cluster's own Ray on the same machine
holds: those are free ports picked here.
"""

import hashlib
import json
import os
import socket

from .protocol import BAD_INPUT, AgentError
from .rayargs import OBJECT_STORE_MEMORY, build_address, check_temp_dir, parse_host_port, parse_ip

PIECE_SUFFIX = "-ray"           # a spanning copy's Ray node is recorded as <copy>-ray
MAX_GPUS = 64
RAY_SHAPE = '{"head": null | "ADDRESS:PORT", "gpus": N}'
CONNECT_TIMEOUT = 1.0


def is_piece(spec_or_record: dict) -> bool:
    return bool(spec_or_record.get("ray"))


def check_ray(ray, env: dict, copy: str) -> dict:
    """The spec's ``ray`` object, checked: ``{"head": None | "host:port", "gpus": N}``."""
    if not isinstance(ray, dict) or set(ray) - {"head", "gpus"}:
        raise AgentError(BAD_INPUT, "ray must be an object %s" % RAY_SHAPE)
    if not copy.endswith(PIECE_SUFFIX):
        raise AgentError(BAD_INPUT, "a copy's Ray node is named after the copy with %r at the end, got %s"
                         % (PIECE_SUFFIX, json.dumps(copy)))
    gpus = ray.get("gpus")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 0 <= gpus <= MAX_GPUS:
        raise AgentError(BAD_INPUT, "ray.gpus must be a whole number from 0 to %d, got %s"
                         % (MAX_GPUS, json.dumps(gpus)[:40]))
    visible = [value for name, value in env.items() if name.endswith("_VISIBLE_DEVICES")]
    counted = len(visible[0].split(",")) if visible and visible[0] else 0
    if counted != gpus:
        raise AgentError(BAD_INPUT, "ray.gpus is %d but the spec's visible devices name %d GPU%s: a copy's Ray "
                                    "node offers exactly the GPUs it may see" % (gpus, counted, "" if counted == 1 else "s"))
    head = ray.get("head")
    if head is not None:
        if not isinstance(head, str):
            raise AgentError(BAD_INPUT, "ray.head must be null (start the copy's Ray head) or ADDRESS:PORT of it")
        host, port = parse_host_port(head, flag="ray.head")
        head = build_address(parse_ip(host, flag="ray.head"), port)
    return {"head": head, "gpus": gpus}


def temp_dir(store: str, copy: str) -> str:
    """The node's Ray temp dir: short (Ray's socket paths under it must fit AF_UNIX's 107 bytes), and
    apart from the cluster's Ray (``<store>/ray``), whose processes are told apart by it."""
    return check_temp_dir(os.path.join(store, "cr", hashlib.sha256(copy.encode()).hexdigest()[:8]))


def free_port(address: str) -> int:
    """A port free on ``address`` now (the kernel's pick), for a port Ray would otherwise fix."""
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
        return sock.getsockname()[1]
    finally:
        sock.close()


def node_argv(ray_executable: str, ray: dict, address: str, temp: str, port, extra: list) -> list:
    """``ray start --block ...`` for the copy's node: the head (GCS on ``port``) or one joining it."""
    common = ["--node-ip-address=%s" % address, "--num-gpus=%d" % ray["gpus"],
              "--dashboard-agent-listen-port=%d" % free_port(address),
              "--object-store-memory=%d" % OBJECT_STORE_MEMORY, "--temp-dir=%s" % temp,
              "--disable-usage-stats"] + list(extra) + ["--log-style=record", "--log-color=false"]
    if ray["head"] is None:
        # Ray with its dashboard's packages starts a dashboard process even without the dashboard, on 8265
        # unless told otherwise: the cluster's head has that port on the same machine.
        return [ray_executable, "start", "--block", "--head", "--port=%d" % port, "--include-dashboard=false",
                "--dashboard-port=%d" % free_port(address),
                "--ray-client-server-port=%d" % free_port(address)] + common
    return [ray_executable, "start", "--block", "--address=%s" % ray["head"]] + common


def answers(address: str, port: int) -> bool:
    """The head's GCS accepts a TCP connection (a node's health: Ray's own ports speak gRPC, not HTTP)."""
    try:
        socket.create_connection((address, port), timeout=CONNECT_TIMEOUT).close()
        return True
    except OSError:
        return False
