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
recorded, listed and stopped like an engine (``copyproc``).  Every port of
it is pinned in ``ports.COPY_RAY`` (20000-20999), beside the cluster's own
Ray's ports, so that the cluster's firewall can name them: free ports of that
range picked here, from a place the copy's name gives (two copies starting at
once rarely meet), the workers a block of ``WORKER_PORTS`` of them.
"""

import hashlib
import json
import os
import socket

from . import copyproc, ports
from .protocol import BAD_INPUT, NOT_RETRYABLE, AgentError
from .rayargs import OBJECT_STORE_MEMORY, build_address, check_temp_dir, parse_host_port, parse_ip

PIECE_SUFFIX = "-ray"           # a spanning copy's Ray node is recorded as <copy>-ray
MAX_GPUS = 64
RAY_SHAPE = '{"head": null | "ADDRESS:PORT", "gpus": N}'
CONNECT_TIMEOUT = 1.0
WORKER_PORTS = 32               # a copy's Ray node: its workers' ports, a block of COPY_RAY
SINGLES = 200                   # COPY_RAY's first ports: a node's single ports; the rest: workers' blocks


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


def _bindable(address: str, port: int) -> bool:
    """Nothing listens on ``port``, on ``address`` or on every address (Ray's gRPC servers take that)."""
    for host in (address, "::" if ":" in address else "0.0.0.0"):
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        finally:
            sock.close()
    return True


class PortPicker:
    """Free ports of ``ports.COPY_RAY`` for one node, never one twice: single ports from its first
    ``SINGLES``, the workers' block from the rest (workers bind late: another copy's block must not be
    taken for free then), each search starting where the copy's name says."""

    def __init__(self, address: str, copy: str):
        self.address = address
        self.start = int(hashlib.sha256(copy.encode()).hexdigest()[:8], 16)
        self.taken = set()

    def one(self) -> int:
        low = ports.COPY_RAY[0]
        for step in range(SINGLES):
            port = low + (self.start + step) % SINGLES
            if port not in self.taken and _bindable(self.address, port):
                self.taken.add(port)
                return port
        raise AgentError(NOT_RETRYABLE, "No free port left in %d-%d on %s for a copy's Ray"
                         % (low, low + SINGLES - 1, self.address))

    def block(self, count: int = WORKER_PORTS) -> tuple:
        """``count`` consecutive free ports: ``(first, last)``."""
        low, high = ports.COPY_RAY[0] + SINGLES, ports.COPY_RAY[1]
        blocks = (high - low + 1) // count
        for step in range(blocks):
            first = low + ((self.start + step) % blocks) * count
            run = range(first, first + count)
            if all(_bindable(self.address, port) for port in run):
                self.taken.update(run)
                return first, first + count - 1
        raise AgentError(NOT_RETRYABLE, "No %d free consecutive ports left in %d-%d on %s for a copy's Ray "
                                        "workers" % (count, low, high, self.address))


def free_port(address: str, copy: str = "") -> int:
    """A free port of ``ports.COPY_RAY`` on ``address`` now (the head's GCS of a copy's Ray)."""
    return PortPicker(address, copy + ":gcs").one()


def node_argv(ray_executable: str, ray: dict, address: str, temp: str, port, extra: list, copy: str = "",
              env=None) -> list:
    """``ray start --block ...`` for the copy's node: the head (GCS on ``port``) or one joining it.  Every
    other port is pinned to a free one of ``ports.COPY_RAY``; ``env`` (a dict) gets the variables that pin
    the rest: the head's two metrics endpoints (Ray serves them on every address) and no metrics exporter."""
    # The head and a node joining it start their searches apart (a test runs both on one address).
    pick = PortPicker(address, "%s:%s" % (copy, "head" if ray["head"] is None else "node"))
    if port:
        pick.taken.add(port)
    first, last = pick.block()
    common = ["--node-ip-address=%s" % address, "--num-gpus=%d" % ray["gpus"],
              "--node-manager-port=%d" % pick.one(), "--object-manager-port=%d" % pick.one(),
              "--dashboard-agent-grpc-port=%d" % pick.one(), "--dashboard-agent-listen-port=%d" % pick.one(),
              "--metrics-export-port=%d" % pick.one(), "--runtime-env-agent-port=%d" % pick.one(),
              "--min-worker-port=%d" % first, "--max-worker-port=%d" % last,
              "--object-store-memory=%d" % OBJECT_STORE_MEMORY, "--temp-dir=%s" % temp,
              "--disable-usage-stats"] + list(extra) + ["--log-style=record", "--log-color=false"]
    if env is not None:
        env["RAY_enable_metrics_collection"] = "0"
        if ray["head"] is None:
            env["DASHBOARD_METRIC_PORT"] = str(pick.one())
            env["AUTOSCALER_METRIC_PORT"] = str(pick.one())
    if ray["head"] is None:
        # Ray with its dashboard's packages starts a dashboard process even without the dashboard, on 8265
        # unless told otherwise: the cluster's head has that port on the same machine.
        return [ray_executable, "start", "--block", "--head", "--port=%d" % port, "--include-dashboard=false",
                "--dashboard-host=127.0.0.1", "--dashboard-port=%d" % pick.one(),
                "--ray-client-server-port=%d" % pick.one()] + common
    return [ray_executable, "start", "--block", "--address=%s" % ray["head"]] + common


def answers(address: str, port: int) -> bool:
    """The head's GCS accepts a TCP connection (a node's health: Ray's own ports speak gRPC, not HTTP)."""
    try:
        socket.create_connection((address, port), timeout=CONNECT_TIMEOUT).close()
        return True
    except OSError:
        return False


def node_command(store: str, spec: dict, driver, env: dict) -> tuple:
    """``(port, argv)`` of a spanning copy's Ray node: the head's GCS port (None for a node joining it)
    and its ``ray start --block`` as the runtime runs it (the store's paths as the container sees them)."""
    temp = temp_dir(store, spec["copy"])
    os.makedirs(temp, mode=0o755, exist_ok=True)
    seen = copyproc.in_container(store, temp) if driver.per_cluster else temp
    port = free_port(spec["address"], spec["copy"]) if spec["ray"]["head"] is None else None
    return port, node_argv(driver.ray, spec["ray"], spec["address"], seen, port, driver.start_args(),
                           spec["copy"], env)
