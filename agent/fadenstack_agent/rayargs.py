"""Ray's command lines, environment and output, for ``ray`` (pure: nothing
here starts a process or touches the machine).  See ``ray`` for the commands.
"""

import ipaddress
import json
import os

from . import ports
from .protocol import BAD_INPUT, NOT_RETRYABLE, AgentError

DEFAULT_PORT = ports.GCS
# Ray's dashboard and job API (``ray job submit --address http://127.0.0.1:8265``) on the head's
# loopback only: a person reaches it through ``faden clusters tunnel`` (SSH to the head), never from
# the network.  Ray's own default host is localhost too; it is given here so no Ray default changes it.
DASHBOARD_HOST = "127.0.0.1"
DASHBOARD_PORT = 8265
OBJECT_STORE_MEMORY = 100000000
START_TIMEOUT = 90.0        # one `ray start` (Ray gives up on a dead GCS after ~40 s)
ALIVE_WAIT = 60.0           # after `ray start`: until Ray reports the node alive
ALREADY_WAIT = 10.0         # an existing node: until Ray confirms it alive
STATUS_LOOKUP = 20.0        # the status driver's GCS requests (finding its raylet, ray.nodes())
STATUS_SLACK = 10.0         # ... plus starting Python and importing Ray: 30 s for `ray status`
CONNECT_TIMEOUT = 5.0       # TCP check of a head's GCS port
STOP_GRACE = 2.0            # SIGTERM -> SIGKILL, each wave (raylet first, then the rest, the GCS last)
UNREACHABLE_GRACE = 0.5     # ... when the GCS does not answer (nothing can end cleanly without it)
GCS_PROBE_TIMEOUT = 1.0     # TCP connect to the GCS before a stop: does it answer
LOCK_WAIT = START_TIMEOUT + ALIVE_WAIT + 30
RESERVED_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
PROXY_VARIABLES = ("http_proxy", "https_proxy", "ftp_proxy", "all_proxy", "no_proxy", "grpc_proxy")

# AF_UNIX paths hold at most 107 bytes on Linux.  Ray puts its sockets at
# <temp>/session_<YYYY-mm-dd_HH-MM-SS_ffffff>_<pid>/sockets/plasma_store[.N].
SOCKET_PATH_MAX = 107
SESSION_NAME_MAX = len("session_2025-01-01_00-00-00_000000_") + 7   # pid_max is 4194304
SOCKET_TAIL = "/sockets/plasma_store"
SOCKET_SUFFIX_MAX = 3                                               # Ray's ".N" on a clash
STATUS_MARK = "FADEN-RAY-STATUS "

# The status script: argv = address, local node ip ("" = Ray's choice), node id
# to wait for ("" = none), address to wait for ("" = none), seconds to wait.
# It asks the GCS for its node table with Ray's own GCS client: no driver is
# registered, no worker or job started (a driver, ray.init, costs some 4 s of
# CPU more on every look).  A Ray without that client (its module is private)
# is asked through a driver, as before.
STATUS_SCRIPT = r'''
import json, sys, time
address, node_ip, wait_id, wait_address, wait_s = sys.argv[1:6]
def emit(obj):
    sys.stdout.write("FADEN-RAY-STATUS " + json.dumps(obj) + "\n")
    sys.stdout.flush()
try:
    import ray
except Exception as exc:
    emit({"error": "import", "message": "%s: %s" % (type(exc).__name__, exc)})
    sys.exit(3)
def gcs_nodes():
    return [{"node_id": info.node_id.hex(), "address": info.node_manager_address,
             "alive": info.state == info.ALIVE, "gpus": dict(info.resources_total).get("GPU", 0)}
            for info in client.get_all_node_info(timeout=20).values()]
def driver_nodes():
    return [{"node_id": n.get("NodeID"), "address": n.get("NodeManagerAddress"),
             "alive": bool(n.get("Alive")), "gpus": (n.get("Resources") or {}).get("GPU", 0)}
            for n in ray.nodes()]
def waited(found):
    return any(n["alive"] and ((wait_id and n["node_id"] == wait_id) or
                               (not wait_id and n["address"] == wait_address)) for n in found)
try:
    try:
        from ray._raylet import GcsClient
        client = GcsClient(address=address)
        nodes = gcs_nodes
        found = nodes()
    except (ImportError, TypeError, AttributeError):  # another Ray's private client: ask through a driver
        kwargs = {"address": address, "log_to_driver": False, "logging_level": "ERROR"}
        if node_ip:
            kwargs["_node_ip_address"] = node_ip
        ray.init(**kwargs)
        nodes = driver_nodes
        found = nodes()
    deadline = time.monotonic() + float(wait_s or 0)
    while (wait_id or wait_address) and not waited(found) and time.monotonic() < deadline:
        time.sleep(0.25)
        found = nodes()
except Exception as exc:
    emit({"error": "connect", "message": "%s: %s" % (type(exc).__name__, exc)})
    sys.exit(4)
emit({"nodes": found})
'''

DRAIN_MARK = "FADEN-RAY-DRAIN "
# Ray's drain (GcsClient.drain_node, the call behind Ray's own hidden ``ray drain-node``): the node takes no new
# task or actor, and Ray lets it go once it runs none. Preemption, not idle termination: Ray refuses the latter
# on a node that still runs something, and a drain starts while the machine's copies still serve.
DRAIN_SCRIPT = r'''
import json, sys
address, node_id, message = sys.argv[1:4]
def emit(obj):
    sys.stdout.write("FADEN-RAY-DRAIN " + json.dumps(obj) + "\n")
    sys.stdout.flush()
try:
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2
except Exception as exc:
    emit({"error": "import", "message": "%s: %s" % (type(exc).__name__, exc)})
    sys.exit(3)
try:
    client = GcsClient(address=address)
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    accepted, refusal = client.drain_node(node_id, reason, message, 0)
except Exception as exc:
    emit({"error": "connect", "message": "%s: %s" % (type(exc).__name__, exc)})
    sys.exit(4)
emit({"accepted": bool(accepted), "refusal": refusal or ""})
'''



# ------------------------------------------------------------------ arguments


def parse_ip(text: str, flag: str = "--address") -> str:
    """An IP address literal (Ray's node address), normalised."""
    try:
        return str(ipaddress.ip_address((text or "").strip()))
    except ValueError:
        raise AgentError(BAD_INPUT, "%s must be an IP address of this machine, got %r" % (flag, text))


def parse_port(value) -> int:
    try:
        port = int(value)
    except (TypeError, ValueError):
        port = -1
    if not 0 < port < 65536:
        raise AgentError(BAD_INPUT, "--port must be a TCP port number (1-65535), got %r" % (value,))
    return port


def parse_host_port(text: str, flag: str = "--head"):
    """``ADDR:PORT`` (``[v6]:PORT`` for IPv6) -> ``(host, port)``."""
    text = (text or "").strip()
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or any(c.isspace() for c in host):
        raise AgentError(BAD_INPUT, "%s must be ADDR:PORT (the head's address and GCS port), got %r"
                         % (flag, text))
    return host, _port_in(port, flag, text)


def _port_in(port: str, flag: str, text: str) -> int:
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise AgentError(BAD_INPUT, "%s must end with a TCP port number, got %r" % (flag, text))
    return int(port)


def build_address(host: str, port: int) -> str:
    return "[%s]:%d" % (host, port) if ":" in host else "%s:%d" % (host, port)


def parse_num_gpus(value) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if number < 0:
        raise AgentError(BAD_INPUT, "--num-gpus must be a whole number >= 0, got %r" % (value,))
    return number


def parse_resources(text):
    """``--resources`` JSON -> dict of name -> non-negative number (or {})."""
    if text is None or not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise AgentError(BAD_INPUT, "--resources must be a JSON object, e.g. '{\"h100\": 8}': %s" % exc)
    if not isinstance(value, dict):
        raise AgentError(BAD_INPUT, "--resources must be a JSON object of name -> number, got %r" % (text,))
    for name, amount in value.items():
        if name in RESERVED_RESOURCES:
            raise AgentError(BAD_INPUT, "--resources must not name %r: Ray sets it itself "
                                        "(use --num-gpus for GPUs)" % name)
        if not name or isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount < 0:
            raise AgentError(BAD_INPUT, "--resources: %r must map to a number >= 0, got %r" % (name, amount))
    return value


def resources_arg(resources: dict) -> list:
    if not resources:
        return []
    return ["--resources=" + json.dumps(resources, sort_keys=True, separators=(",", ":"))]


# ------------------------------------------------------------------ argv and environment


def temp_dir(store: str) -> str:
    return os.path.join(store, "ray")


def longest_socket_path(temp: str) -> int:
    """Bytes of the longest AF_UNIX path Ray makes under ``temp``."""
    return len(temp.encode("utf-8")) + 1 + SESSION_NAME_MAX + len(SOCKET_TAIL) + SOCKET_SUFFIX_MAX


def check_temp_dir(temp: str) -> str:
    """Refuse a Ray temp dir whose socket paths would not fit in AF_UNIX's 107 bytes."""
    longest = longest_socket_path(temp)
    if longest > SOCKET_PATH_MAX:
        room = SOCKET_PATH_MAX - (longest - len(temp.encode("utf-8")))
        raise AgentError(NOT_RETRYABLE, "Ray's temp dir %s is too long: Ray's socket paths under it would "
                                        "take up to %d bytes, and a Unix socket path holds at most %d; "
                                        "use a store whose path makes <store>/ray at most %d bytes long"
                         % (temp, longest, SOCKET_PATH_MAX, room))
    return temp


def port_args() -> list:
    """Every port of a node's Ray pinned (``ports``), so that the cluster's firewall can name them."""
    return ["--node-manager-port=%d" % ports.NODE_MANAGER, "--object-manager-port=%d" % ports.OBJECT_MANAGER,
            "--dashboard-agent-grpc-port=%d" % ports.DASHBOARD_AGENT_GRPC,
            "--dashboard-agent-listen-port=%d" % ports.DASHBOARD_AGENT_HTTP,
            "--metrics-export-port=%d" % ports.METRICS_EXPORT, "--runtime-env-agent-port=%d" % ports.RUNTIME_ENV_AGENT,
            "--min-worker-port=%d" % ports.WORKERS[0], "--max-worker-port=%d" % ports.WORKERS[1]]


def common_start_args(driver, temp: str, num_gpus: int, resources: dict) -> list:
    return (["--num-gpus=%d" % num_gpus] + resources_arg(resources) + port_args()
            + ["--object-store-memory=%d" % OBJECT_STORE_MEMORY, "--temp-dir=%s" % temp,
               "--disable-usage-stats"] + driver.start_args()
            + ["--log-style=record", "--log-color=false"])


def dashboard_args() -> list:
    """The head's dashboard, asked for outright: a Ray without ``ray[default]``'s packages then fails
    its start with "Cannot include dashboard with missing packages" instead of starting without the
    dashboard the tunnel reaches; on the head's loopback only.  The Ray Client server's port is
    pinned (``ports.RAY_CLIENT``); it has no flag for its host: it listens on the node's address."""
    return ["--include-dashboard=true", "--dashboard-host=%s" % DASHBOARD_HOST, "--dashboard-port=%d" % DASHBOARD_PORT,
            "--ray-client-server-port=%d" % ports.RAY_CLIENT]


def head_start_argv(driver, address: str, port: int, num_gpus: int, resources: dict, temp: str) -> list:
    return driver.ray_argv("start", "--head", "--node-ip-address=%s" % address, "--port=%d" % port,
                           *dashboard_args(), *common_start_args(driver, temp, num_gpus, resources))


def join_argv(driver, head: str, address: str, num_gpus: int, resources: dict, temp: str) -> list:
    # --include-dashboard, --dashboard-* and --port are head-only flags: `ray start` refuses them here.
    return driver.ray_argv("start", "--address=%s" % head, "--node-ip-address=%s" % address,
                           *common_start_args(driver, temp, num_gpus, resources))


def drain_argv(driver, head: str, node_id: str, message: str) -> list:
    return driver.python_argv("-c", DRAIN_SCRIPT, head, node_id, message)


def parse_node_id(text: str) -> str:
    """A Ray node id: 56 hexadecimal digits (Ray's NodeID), lower case."""
    value = (text or "").strip().lower()
    if len(value) != 56 or any(c not in "0123456789abcdef" for c in value):
        raise AgentError(BAD_INPUT, "--node-id: %r is not a Ray node id (56 hexadecimal digits)" % (text,))
    return value


def status_argv(driver, head: str, node_ip=None, wait_id=None, wait_address=None, wait=0.0) -> list:
    return driver.python_argv("-c", STATUS_SCRIPT, head, node_ip or "", wait_id or "",
                              wait_address or "", "%g" % wait)


def ray_env(base=None) -> dict:
    """The environment Ray runs in: ours, minus proxies and RAY_ADDRESS, no usage stats, and no
    workers started ahead for the first driver: that driver is always our status driver (the
    alive check after ``ray start``), which runs no task, so the workers Ray would start for it
    (one per CPU, each importing Ray) only take the CPU the start needs."""
    env = dict(os.environ if base is None else base)
    for name in list(env):
        if name.lower() in PROXY_VARIABLES or name == "RAY_ADDRESS":
            del env[name]
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_prestart_worker_first_driver"] = "0"
    # No metrics exporter: Ray's Prometheus endpoint listens on every interface whatever the node's
    # address, and nothing of Fadenstack reads it.
    env["RAY_enable_metrics_collection"] = "0"
    # The head's dashboard and autoscaler metrics listen on every address (Ray has no host for them):
    # on pinned ports, which the firewall names.
    env["DASHBOARD_METRIC_PORT"] = str(ports.DASHBOARD_METRICS)
    env["AUTOSCALER_METRIC_PORT"] = str(ports.AUTOSCALER_METRICS)
    return env


# ------------------------------------------------------------------ Ray's output


def parse_status_output(stdout: str, mark: str = STATUS_MARK):
    """The status (or drain) script's JSON line (the last one marked), or None."""
    found = None
    for line in (stdout or "").splitlines():
        if line.startswith(mark):
            try:
                value = json.loads(line[len(mark):])
            except ValueError:
                continue
            if isinstance(value, dict):
                found = value
    return found


def summarize_nodes(nodes: list) -> dict:
    alive = [n for n in nodes if n.get("alive")]
    gpus = sum(float(n.get("gpus") or 0) for n in alive)
    return {"alive_nodes": len(alive), "gpus": int(gpus) if gpus == int(gpus) else gpus}


def _strip(line: str) -> str:
    return line.strip().strip("\x1b").strip()


def in_use_words(*texts) -> str:
    """Ray's own words when a port it wanted was taken ('' when none)."""
    for text in texts:
        for line in (text or "").splitlines():
            low = line.lower()
            if "failed to start the grpc server" in low:
                # gRPC's hint names `Address already in use` whatever the cause:
                # keep Ray's fact, not the hint.
                start = low.index("failed to start the grpc server")
                sentence = line[start:].split(" This means", 1)[0].strip()
                return sentence
            if "already occupied" in low or "is already in use" in low:
                return _strip(line)[:500]
    return ""


def port_taken_in_logs(*texts) -> bool:
    """Did the OS refuse a bind with EADDRINUSE (as gRPC / Ray log it)?"""
    for text in texts:
        low = (text or "").lower()
        if ('os_error:"address already in use"' in low or "errno:98" in low or "already occupied" in low
                or "[errno 98]" in low):
            return True
    return False


# Ray's words for a failure whose cause they do not name, and what it means here.
KNOWN_FAILURES = (
    ("Cannot include dashboard with missing packages",
     "the runtime's Ray has no dashboard packages (it is ray, not ray[default]), and the head's Ray "
     "starts with its dashboard: the runtime image needs ray[default]"),
)


def summarize_failure(text: str, limit: int = 800) -> str:
    """The gist of a failed ``ray start``: the exception line and what follows
    it, else the last non-empty line (tracebacks and log noise left out); a
    failure of ``KNOWN_FAILURES`` says what it means before Ray's words."""
    gist = _gist(text, limit)
    for words, meaning in KNOWN_FAILURES:
        if words in (text or ""):
            return ("%s; Ray: %s" % (meaning, gist))[:limit]
    return gist


def _gist(text: str, limit: int) -> str:
    lines = [line.rstrip() for line in (text or "").splitlines()]
    for index in range(len(lines) - 1, -1, -1):
        line = lines[index]
        head = line.split(":", 1)[0]
        if line and not line.startswith(" ") and head.isidentifier() and (
                head.endswith("Error") or head.endswith("Exception")):
            gist = " ".join(part.strip() for part in lines[index:index + 6] if part.strip())
            return gist[:limit]
    rest = [line.strip() for line in lines if line.strip()]
    return rest[-1][:limit] if rest else "no output"


def status_env(lookup: float) -> dict:
    """The status driver's environment: Ray's, with its GCS requests bounded
    to ``lookup`` s (a driver waits that long for a raylet registered at its
    address: 60 s by default, far beyond our own deadlines)."""
    env = ray_env()
    env["RAY_gcs_server_request_timeout_seconds"] = str(max(5, int(lookup)))
    return env
