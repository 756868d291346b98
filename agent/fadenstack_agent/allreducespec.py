"""The NCCL test's pure parts (``allreduce``): the spec from stdin checked, and what runs, built from
it: mpirun's argv, the launcher (Open MPI's rsh agent, which holds no key: it asks the head's agent),
a launch request checked, the agent's ssh to a node and the run's SSH config, the pid-file wrapper and the signal sent inside a container, a node's NCCL settings from its cluster.env.
Nothing here starts a process; tests/agent/test_allreduce.py holds each to its text.
"""

import ipaddress
import json
import re
import shlex

from .containers import CLUSTER_RE
from .nodeedit import Root
from .nodespec import ENV_PATH
from .protocol import BAD_INPUT, AgentError

PROGRAM = "all_reduce_perf"
MPIRUN = "mpirun"
NODES_VARIABLE = "FADEN_ALLREDUCE_NODES"  # mpirun -x: every rank's environment
SLOTS_VARIABLE = "FADEN_ALLREDUCE_SLOTS"  # and each node's number of processes (its GPUs)
MAX_NODES, MAX_GPUS = 256, 64
MAX_BYTES = 16 * 1024 ** 3
TIMEOUT_MAX = 3600
ENV_PREFIXES = ("NCCL_", "GLOO_")  # this node's settings from cluster.env that reach the ranks it runs
SPEC_KEYS = ("cluster", "nodes", "minbytes", "maxbytes", "iters", "warmup", "check", "timeout")
SPEC_SHAPE = ('{"cluster": "NAME", "nodes": [{"name": "node-0", "address": "198.18.1.11", "gpus": 1}, ...], '
              '"minbytes": 1048576, "maxbytes": 67108864, "iters": 5, "warmup": 1, "check": true, "timeout": 600}')


# ------------------------------------------------------------------ the spec


def _whole(spec: dict, key: str, low: int, high: int) -> int:
    value = spec.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise AgentError(BAD_INPUT, "the allreduce spec's %s must be a whole number from %d to %d, got %s"
                         % (key, low, high, json.dumps(value)[:40]))
    return value


def _check_nodes(nodes) -> list:
    if not isinstance(nodes, list) or not 1 <= len(nodes) <= MAX_NODES:
        raise AgentError(BAD_INPUT, "the allreduce spec's nodes must be a list of 1 to %d nodes, head first"
                         % MAX_NODES)
    checked, seen = [], set()
    for index, node in enumerate(nodes):
        if not isinstance(node, dict) or set(node) != {"name", "address", "gpus"}:
            raise AgentError(BAD_INPUT, "nodes[%d] must be {\"name\", \"address\", \"gpus\"}, got %s"
                             % (index, json.dumps(node)[:120]))
        name, address = node["name"], node["address"]
        if not isinstance(name, str) or not CLUSTER_RE.match(name):
            raise AgentError(BAD_INPUT, "nodes[%d].name must be a node's name (node-0), got %s"
                             % (index, json.dumps(name)[:40]))
        try:
            address = str(ipaddress.ip_address(address))
        except ValueError:
            raise AgentError(BAD_INPUT, "nodes[%d].address must be an IP address, got %s"
                             % (index, json.dumps(address)[:60]))
        gpus = _whole(node, "gpus", 1, MAX_GPUS)
        if address in seen:
            raise AgentError(BAD_INPUT, "the address %s is in the allreduce spec's nodes twice" % address)
        seen.add(address)
        checked.append({"name": name, "address": address, "gpus": gpus})
    return checked


def check_spec(spec) -> dict:
    """The spec from stdin, every field checked (``bad_input`` saying which and why)."""
    if not isinstance(spec, dict):
        raise AgentError(BAD_INPUT, "the allreduce spec on stdin must be one JSON object %s" % SPEC_SHAPE)
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise AgentError(BAD_INPUT, "the allreduce spec has unknown keys: %s" % ", ".join(unknown))
    cluster = spec.get("cluster")
    if not isinstance(cluster, str) or not CLUSTER_RE.match(cluster):
        raise AgentError(BAD_INPUT, "the allreduce spec's cluster must be a cluster name, got %s"
                         % json.dumps(cluster)[:80])
    checked = {"cluster": cluster, "nodes": _check_nodes(spec.get("nodes")),
               "minbytes": _whole(spec, "minbytes", 1, MAX_BYTES), "maxbytes": _whole(spec, "maxbytes", 1, MAX_BYTES),
               "iters": _whole(spec, "iters", 1, 10000), "warmup": _whole(spec, "warmup", 0, 1000),
               "timeout": _whole(spec, "timeout", 1, TIMEOUT_MAX)}
    if checked["minbytes"] > checked["maxbytes"]:
        raise AgentError(BAD_INPUT, "the allreduce spec's minbytes (%d) is above its maxbytes (%d)"
                         % (checked["minbytes"], checked["maxbytes"]))
    if not isinstance(spec.get("check"), bool):
        raise AgentError(BAD_INPUT, "the allreduce spec's check must be true or false, got %s"
                         % json.dumps(spec.get("check"))[:40])
    checked["check"] = spec["check"]
    return checked


# ------------------------------------------------------------------ what runs (pure)


def hosts_arg(nodes: list) -> str:
    """mpirun's ``--host``: the nodes' addresses in rank order, a slot (a process) per GPU (no hostfile:
    nothing of the run is a file the runtime could change)."""
    return ",".join("%s:%d" % (node["address"], node["gpus"]) for node in nodes)


def mpirun_argv(spec: dict, launcher: str, program: str = PROGRAM) -> list:
    """The whole run, one process per GPU (``-g 1``): what nccl-tests users do for nodes of different
    GPU counts, since ``-g`` is one number for every process. mpirun fills each node's slots (its GPUs)
    in ``--host``'s order, so a node's ranks follow each other. ``launcher``: the launcher's path as the
    runtime sees it, run by the runtime's ``python3`` (so the nodes' daemons, which look the rsh agent's
    first word up, find it without a copy of the launcher). No tree spawn: only the head launches; the
    daemons stay in their sessions (not daemonized), where each node's ``allreduce exec`` watches them;
    binding off: NCCL picks each rank's GPU itself. Every rank gets the nodes' addresses in rank order
    and their process counts (``NODES_VARIABLE``, ``SLOTS_VARIABLE``): nccl-tests has MPI and ignores
    them; the lab's all_reduce_perf, which has none, finds its peers so."""
    nodes = spec["nodes"]
    return [MPIRUN, "--allow-run-as-root", "--leave-session-attached", "--host", hosts_arg(nodes),
            "-np", str(sum(node["gpus"] for node in nodes)), "--map-by", "slot", "--bind-to", "none",
            "--mca", "plm_rsh_agent", "%s %s" % (LAUNCHER_PYTHON, launcher), "--mca", "plm_rsh_no_tree_spawn", "1",
            "-x", "%s=%s" % (NODES_VARIABLE, ",".join(node["address"] for node in nodes)),
            "-x", "%s=%s" % (SLOTS_VARIABLE, ",".join(str(node["gpus"]) for node in nodes)),
            program, "-b", str(spec["minbytes"]), "-e", str(spec["maxbytes"]), "-f", "2",
            "-g", "1", "-n", str(spec["iters"]), "-w", str(spec["warmup"]),
            "-c", "1" if spec["check"] else "0"]


def remote_agent_argv(cluster: str, zip_path, source) -> list:
    """How another node's agent is called over SSH: the same build as this one (same path), or from
    a source tree (tests) as a module with that tree on PYTHONPATH."""
    if zip_path:
        program = ["python3", zip_path]
    else:
        program = ["env", "PYTHONPATH=%s" % source, "python3", "-m", "fadenstack_agent"]
    return program + ["allreduce", "exec", "--cluster", cluster, "--command"]


def ssh_argv(config: str, host: str, remote: list, command: str) -> list:
    """The head's agent (on the machine, never in the runtime) to another node over the cluster's SSH:
    ``config`` the run's SSH config (root's block for the nodes, with root's own key), the remote
    shell given ``remote`` and the daemon's command line as one quoted word, which that node's
    ``allreduce exec`` runs in its own runtime."""
    return ["ssh", "-F", config, "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "--", host,
            shlex.join(list(remote) + [command])]


# The launcher (Open MPI's rsh agent) in the runtime: ``python3 launch HOST WORDS...``. It holds no key
# and reaches no node itself: it asks the head's agent, over the agent's socket for this run (an
# abstract Unix socket: the runtime shares the machine's network namespace, so no mount is needed),
# to launch WORDS (the daemon's command line) on HOST, handing it its stdout and stderr (SCM_RIGHTS)
# for the daemon's output, and exits with the daemon's exit status, which the agent sends back.
LAUNCHER_PYTHON = "python3"
LAUNCHER = r"""# Written by fadenstack-agent for `allreduce run`: Open MPI's launcher (plm_rsh_agent) to the other nodes.
# mpirun calls it as: python3 launch HOST WORDS...; the head's agent launches them on HOST (it holds the SSH).
import array, json, socket, sys
try:
    agent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    agent.connect("\0" + %(socket)r)
    request = json.dumps({"host": sys.argv[1], "command": " ".join(sys.argv[2:])}).encode() + b"\n"
    try:
        agent.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [1, 2]))])
    except BrokenPipeError:
        pass  # refused before it read: its answer says why
    answer = b""
    while not answer.endswith(b"\n"):
        chunk = agent.recv(4096)
        if not chunk:
            break
        answer += chunk
except (OSError, IndexError) as exc:
    sys.stderr.write("allreduce launcher: cannot reach the agent's launches: %%s\n" %% exc)
    sys.exit(255)
word, _, rest = answer.decode("utf-8", "replace").strip().partition(" ")
if word == "exit" and rest.isdigit():
    sys.exit(int(rest))
sys.stderr.write("allreduce launcher: %%s\n" %% (rest or "the agent ended the launch"))
sys.exit(255)
"""


def launcher_text(socket_name: str) -> str:
    """The launcher for one run, ``socket_name`` its agent's abstract socket (without the NUL)."""
    if not SOCKET_RE.match(socket_name):
        raise AgentError(BAD_INPUT, "not a launch socket's name: %r" % (socket_name,))
    return LAUNCHER % {"socket": socket_name}


SOCKET_RE = re.compile(r"^fadenstack-allreduce-[0-9a-f]{32}$")
MAX_COMMAND = 65536


def check_launch(request: dict, hosts) -> tuple:
    """A launcher's request ``{"host", "command"}`` -> ``(host, command)``: ``host`` one of ``hosts``
    (the run's nodes, each once: the caller takes it out), ``command`` one line of
    printable text. Anything else: ``bad_input`` saying why (the launcher prints it for mpirun)."""
    if not isinstance(request, dict) or set(request) != {"host", "command"}:
        raise AgentError(BAD_INPUT, "a launch is {\"host\", \"command\"}")
    host, command = request["host"], request["command"]
    if not isinstance(host, str) or host not in hosts:
        raise AgentError(BAD_INPUT, "%s is not a node of this run left to launch" % json.dumps(host)[:80])
    if (not isinstance(command, str) or not command.strip() or len(command) > MAX_COMMAND
            or any(ord(c) < 32 and c != "\t" or ord(c) == 127 for c in command)):
        raise AgentError(BAD_INPUT, "the command to launch must be one line of text (at most %d characters)"
                         % MAX_COMMAND)
    return host, command


def run_ssh_config(block: str, key: str, known_hosts: str) -> str:
    """Root's block for the nodes, its key and known_hosts paths as given (root's own files where
    ``node files write`` put them: the agent reads them on the machine, nothing is copied)."""
    lines = []
    for line in block.splitlines():
        words = line.split()
        if words and words[0].lower() == "identityfile":
            line = "    IdentityFile %s" % key
        elif words and words[0].lower() == "userknownhostsfile":
            line = "    UserKnownHostsFile %s" % known_hosts
        lines.append(line)
    return "\n".join(lines) + "\n"


def pid_wrapped(argv: list, pidfile: str) -> list:
    """``sh -c`` that writes its pid, then becomes ``argv``: the run's pid as the runtime sees it, for
    signals sent inside a container (its pids are not the machine's)."""
    return ["sh", "-c", 'mkdir -p -m 700 "${0%/*}" && echo $$ > "$0" && exec "$@"', pidfile] + list(argv)


def kill_argv(signal_name: str, pidfile: str) -> list:
    return ["sh", "-c", 'kill -s "$0" "$(cat "$1")" 2>/dev/null || true', signal_name, pidfile]


def node_env(root: Root) -> dict:
    """This node's NCCL_* and GLOO_* settings from its cluster.env (the network NCCL and Gloo use here),
    for the ranks it runs; {} when the file is not there."""
    try:
        with open(root.real(ENV_PATH)) as handle:
            text = handle.read()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        if "=" not in line or line.lstrip().startswith("#"):
            continue
        name, _, quoted = line.partition("=")
        if name.startswith(ENV_PREFIXES):
            try:
                words = shlex.split(quoted)
            except ValueError:
                continue
            found[name] = words[0] if words else ""
    return found
