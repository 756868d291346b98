"""``ray start-head|join|status|stop``: Ray on this machine, run through the
runtime driver (module ``runtime``).  The agent never imports Ray: it runs the
driver's ``ray`` and ``python`` executables as subprocesses (argv lists, with
timeouts) and reads what they print.

- ``ray start-head --address ADDR [--port 6379] --num-gpus N [--resources JSON]``
  runs ``ray start --head --node-ip-address=ADDR --port=P --num-gpus=N
  [--resources=JSON] --object-store-memory=100000000 --include-dashboard=true --dashboard-host=127.0.0.1 --dashboard-port=8265
  --temp-dir=<store>/ray --disable-usage-stats`` plus the driver's arguments
  (``--num-cpus=1`` for ``process``) and ``--log-style=record
  --log-color=false``.  Before that, a bind attempt on ADDR:P (and on the
  wildcard address, which Ray's GCS binds): a port held by something else is
  error ``address_in_use`` at once (Ray itself would take some 40 s to give
  up).  The head counts as up only once Ray reports the node alive
  (``ray.nodes()``, polled for at most ``ALIVE_WAIT`` s).  A head already
  running at that address: result with ``already_running: true``.
- ``ray join --head ADDR:PORT --address ADDR --num-gpus N [--resources JSON]``
  likewise with ``ray start --address=HEAD``; the head must answer a TCP
  connect first (else ``unreachable``).  Already joined: ``already_running``.
- ``ray status --head ADDR:PORT``: ``<python> -I -c STATUS_SCRIPT`` asks the
  GCS for its node table with Ray's GCS client (no driver registered: a
  ``ray.init`` only where that client is missing) and prints the nodes; 30 s
  at most.
- ``ray drain``: Ray's own drain of a node, asked on the head (``raydrain``).
- ``ray reach --head ADDR:PORT``: can this machine open a TCP connection to
  the head's GCS (a machine joining a running cluster is checked with it).
- ``ray stop``: SIGTERM (the raylet first, the GCS last), then SIGKILL to
  what is still there ``STOP_GRACE`` s later, to this machine's Ray processes
  only (see ``rayproc.ray_processes``: never Ray's own ``ray stop``, which
  kills every Ray process it can see, and lab machines share one process
  table); the order and its exceptions are ``raystop.terminate``'s.

With the ``docker`` and ``podman`` drivers, ``ray`` and ``python`` run in the
runtime container (``<engine> exec``), Ray's temp dir is the store's as the
container sees it, and Ray's processes are looked for in the container (the
driver's ``ray_temp_dir`` and ``processes``; ``rayproc.ray_view``).

Ray's environment: the agent's, without proxy variables and ``RAY_ADDRESS``,
with ``RAY_USAGE_STATS_ENABLED=0`` and ``RAY_prestart_worker_first_driver=0``
(no workers started ahead for the status driver).  The output of the last
``ray start`` is kept in ``<store>/runtime/ray-start.log``; what the agent started is recorded
in ``<store>/runtime/ray.json``.  Command lines, environment and the parsing
of Ray's output live in ``rayargs``; processes, records, the lock and the
local network checks in ``rayproc``.
"""


import os
import signal
import subprocess
import time

from . import runtime
from .cli import STORE, arg, command, group
from .files import runtime_dir, store_dir
from .protocol import ADDRESS_IN_USE, NOT_RETRYABLE, RETRYABLE, AgentError
from .rayargs import (ALIVE_WAIT, ALREADY_WAIT, DEFAULT_PORT, START_TIMEOUT, STATUS_LOOKUP,
                      STATUS_SLACK, build_address, check_temp_dir, head_start_argv, join_argv,
                      parse_host_port, parse_ip, parse_num_gpus, parse_port, parse_resources,
                      parse_status_output, ray_env, status_argv, status_env, summarize_failure,
                      summarize_nodes, temp_dir)
from .rayproc import (check_local_address, check_reachable, local_node, node_from_processes,
                      port_holder_message, ray_lock, ray_processes, ray_view, read_record, read_tail,
                      resolve_head, start_failure, write_record)
from .raystop import signal_quietly, stop_locked, stop_processes

group("ray", help="Ray on this machine")
HEAD = arg("--head", required=True, metavar="ADDR:PORT", help="the head's GCS address")
ADDRESS = arg("--address", required=True, metavar="ADDR", help="this machine's address for Ray")
NODE = [arg("--num-gpus", required=True, metavar="N", help="GPUs this node offers"),
        arg("--resources", metavar="JSON", help="custom resources, e.g. '{\"h100\": 8}'"), STORE]


# ------------------------------------------------------------------ running Ray


def _whole(number):
    return int(number) if isinstance(number, float) and number == int(number) else number


def _text(data) -> str:
    if data is None:
        return ""
    return data if isinstance(data, str) else data.decode("utf-8", "replace")


def run_status(driver, head: str, node_ip=None, wait_id=None, wait_address=None, wait: float = 0.0,
               lookup: float = STATUS_LOOKUP) -> dict:
    """Run the status script once: at most ``wait`` s polling for a node,
    ``lookup`` s for each of Ray's GCS requests, and STATUS_SLACK s more for
    starting Python and Ray; its JSON (``{"nodes": [...]}``) or AgentError."""
    argv = status_argv(driver, head, node_ip, wait_id, wait_address, wait)
    timeout = wait + max(5, int(lookup)) + STATUS_SLACK
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=status_env(lookup), cwd="/", timeout=timeout)
    except (FileNotFoundError, PermissionError) as exc:
        raise AgentError(NOT_RETRYABLE, "cannot run %s: %s" % (argv[0], exc.strerror or exc))
    except subprocess.TimeoutExpired:
        raise AgentError(RETRYABLE, "Ray at %s did not answer within %g s" % (head, timeout))
    answer = parse_status_output(_text(proc.stdout))
    if answer is None:
        raise AgentError(RETRYABLE, "the Ray status driver printed no answer (exit %s): %s"
                         % (proc.returncode, summarize_failure(_text(proc.stderr) or _text(proc.stdout))))
    if answer.get("error") == "import":
        raise AgentError(NOT_RETRYABLE, "%s cannot import Ray (%s driver): %s"
                         % (driver.python, driver.name, answer.get("message")))
    if answer.get("error"):
        raise AgentError(RETRYABLE, "Ray at %s: %s" % (head, answer.get("message")))
    if not isinstance(answer.get("nodes"), list):
        raise AgentError(RETRYABLE, "the Ray status driver's answer has no nodes: %r" % (answer,))
    return answer


def wait_alive(driver, head: str, node: dict, address: str, wait: float) -> dict:
    """Ask Ray until it reports this machine's node alive (at most ``wait`` s)."""
    deadline = time.monotonic() + wait
    node_id = node.get("node_id") if node else None
    node_ip = (node.get("node_ip") if node else None) or address
    last = None
    while True:
        left = deadline - time.monotonic()
        try:
            answer = run_status(driver, head, node_ip, node_id, address, max(left, 0.0),
                                lookup=min(STATUS_LOOKUP, max(left, 5.0)))
            for entry in answer["nodes"]:
                if entry.get("alive") and (entry.get("node_id") == node_id if node_id
                                           else entry.get("address") == address):
                    return {"node": entry, "nodes": answer["nodes"]}
            last = "Ray lists %d node(s), not this one alive" % len(answer["nodes"])
        except AgentError as exc:
            if exc.kind == NOT_RETRYABLE:
                raise
            last = exc.message
        if deadline - time.monotonic() <= 0.5:
            raise AgentError(RETRYABLE, "Ray did not report node %s (%s) alive within %g s: %s"
                             % ((node_id or "?")[:12], address, wait, last))
        time.sleep(0.5)


def run_ray_start(driver, store: str, argv: list) -> tuple:
    """Run ``ray start`` in a session of its own (its daemons stay in it, so the
    session id finds them again); output to ``ray-start.log`` (a pipe would be
    held open by the daemons).  Returns ``(exit status | None, output)``."""
    log_path = os.path.join(runtime_dir(store), "ray-start.log")
    os.makedirs(os.path.dirname(log_path), mode=0o755, exist_ok=True)
    with open(log_path, "wb") as log:
        log.write(("$ %s\n" % " ".join(argv)).encode("utf-8"))
        log.flush()
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=ray_env(), cwd="/", start_new_session=True)
        except (FileNotFoundError, PermissionError) as exc:
            raise AgentError(NOT_RETRYABLE, "cannot run %s: %s" % (argv[0], exc.strerror or exc))
    sids = [s for s in read_record(store).get("sids", []) if s != proc.pid] + [proc.pid]
    write_record(store, sids=sids[-8:])
    try:
        code = proc.wait(timeout=START_TIMEOUT)
    except subprocess.TimeoutExpired:
        code = None
        signal_quietly(proc.pid, signal.SIGKILL)
        proc.wait()
    return code, read_tail(log_path)


def _start_node(driver, store: str, out, argv: list, gcs: str, address: str, port) -> tuple:
    """Run ``ray start`` and wait until Ray reports the node alive.  On failure
    whatever it left running is stopped, so that a retry starts clean."""
    started, wall = time.monotonic(), time.time()
    out.log("running: %s" % " ".join(argv))
    code, output = run_ray_start(driver, store, argv)
    start_seconds = time.monotonic() - started
    if code != 0:
        error = start_failure(store, code, output, address, port, since=wall, driver=driver)
        stop_processes(store, out, driver)
        raise error
    temp, procs = ray_view(store, driver)
    node = local_node(temp, read_record(store).get("sids", ()), procs)
    out.log("ray start finished in %.1f s; waiting for Ray to report node %s alive"
            % (start_seconds, (node or {}).get("node_id", "?")[:12]))
    try:
        alive = wait_alive(driver, gcs, node, address, ALIVE_WAIT)
    except AgentError:
        stop_processes(store, out, driver)
        raise
    return alive, {"ray_start": round(start_seconds, 3),
                   "alive": round(time.monotonic() - started - start_seconds, 3)}


def _existing(driver, store: str, out, matches, describe, gcs: str, address: str):
    """A Ray node already here: the alive answer when it is the one asked for,
    an error when it is another; None when nothing (left over) runs."""
    temp, procs = ray_view(store, driver)
    procs = ray_processes(temp, read_record(store).get("sids", ()), procs)
    node = node_from_processes(procs, temp)
    if node is not None and not matches(node):
        role = "the head at %s" % node["gcs_address"] if node["head"] else \
            "a node (%s) of the cluster whose head is %s" % (node["node_ip"], node["gcs_address"])
        raise AgentError(NOT_RETRYABLE, "Ray already runs on this machine as %s, not as %s: "
                                        "`ray stop` it first" % (role, describe))
    if node is not None:
        try:
            return wait_alive(driver, gcs, node, address, ALREADY_WAIT)
        except AgentError as exc:
            if exc.kind == NOT_RETRYABLE:
                raise
            out.log("Ray's processes are here but Ray does not report the node alive (%s): "
                    "starting it again" % exc.message)
    if procs:
        stop_processes(store, out, driver)
    return None


# ------------------------------------------------------------------ commands


def _node_setup(args, address: str) -> tuple:
    """What ``start-head`` and ``join`` check alike before touching Ray: the GPUs and resources
    asked for, the store, a started runtime, Ray's temp directory (as Ray sees it: in a
    container, the store's mount point), and ADDR being this machine's.  Returns
    ``(num_gpus, resources, store, driver, temp)``."""
    num_gpus = parse_num_gpus(args.num_gpus)
    resources = parse_resources(args.resources)
    store = store_dir(args.store)
    driver = runtime.require_started(store)
    temp = check_temp_dir(driver.ray_temp_dir(store))
    check_local_address(address)
    return num_gpus, resources, store, driver, temp


@command("ray", "start-head", args=[
    ADDRESS, arg("--port", default=DEFAULT_PORT, metavar="PORT", help="the GCS port (default 6379)")] + NODE)
def cmd_start_head(args, out) -> int:
    """``ray start-head --address ADDR [--port 6379] --num-gpus N [--resources JSON]``.

    Result: ``{"already_running": bool, "address", "port", "gcs_address",
    "node_id", "num_gpus", "resources", "temp_dir", "nodes": [...],
    "seconds", "timings": {"ray_start", "alive"}}``.  Errors:
    ``address_in_use`` (the port is held), ``not_retryable`` (runtime not
    started, ADDR not this machine's, Ray already here in another role),
    ``retryable`` (Ray failed to start or to report the node alive).
    """
    started = time.monotonic()
    address = parse_ip(args.address)
    port = parse_port(args.port)
    num_gpus, resources, store, driver, temp = _node_setup(args, address)
    gcs = build_address(address, port)
    with ray_lock(store):
        already = _existing(driver, store, out,
                            lambda node: node["head"] and node["gcs_address"] == gcs
                            and node["node_ip"] == address,
                            "the head at %s" % gcs, gcs, address)
        if already is not None:
            return out.result(already_running=True, address=address, port=port, gcs_address=gcs,
                              node_id=already["node"]["node_id"], num_gpus=_whole(already["node"]["gpus"]),
                              resources=resources, temp_dir=temp, nodes=already["nodes"],
                              seconds=round(time.monotonic() - started, 3), timings={})
        held = port_holder_message(address, port)
        if held:
            raise AgentError(ADDRESS_IN_USE, "%s: another process holds it, so Ray's GCS cannot listen "
                                             "there" % held)
        os.makedirs(temp_dir(store), mode=0o755, exist_ok=True)   # Ray's temp, as the machine sees it
        argv = head_start_argv(driver, address, port, num_gpus, resources, temp)
        write_record(store, role="head", address=address, port=port, gcs_address=gcs,
                      started_at=round(time.time(), 3))
        alive, timings = _start_node(driver, store, out, argv, gcs, address, port)
        write_record(store, node_id=alive["node"]["node_id"])
    return out.result(already_running=False, address=address, port=port, gcs_address=gcs,
                      node_id=alive["node"]["node_id"], num_gpus=num_gpus, resources=resources,
                      temp_dir=temp, nodes=alive["nodes"], seconds=round(time.monotonic() - started, 3),
                      timings=timings)


@command("ray", "join", args=[HEAD, ADDRESS] + NODE)
def cmd_join(args, out) -> int:
    """``ray join --head ADDR:PORT --address ADDR --num-gpus N [--resources JSON]``.

    Result: ``{"already_running": bool, "head", "address", "node_id",
    "num_gpus", "resources", "nodes": [...], "seconds", "timings"}``.  Errors:
    ``unreachable`` (the head's GCS port does not answer), ``not_retryable``,
    ``retryable`` as for ``start-head``.
    """
    started = time.monotonic()
    host, port = parse_host_port(args.head)
    address = parse_ip(args.address)
    num_gpus, resources, store, driver, temp = _node_setup(args, address)
    head = build_address(resolve_head(host), port)
    with ray_lock(store):
        already = _existing(driver, store, out,
                            lambda node: not node["head"] and node["gcs_address"] == head
                            and node["node_ip"] == address,
                            "a node (%s) of the cluster whose head is %s" % (address, head), head, address)
        if already is not None:
            return out.result(already_running=True, head=head, address=address,
                              node_id=already["node"]["node_id"], num_gpus=_whole(already["node"]["gpus"]),
                              resources=resources, nodes=already["nodes"],
                              seconds=round(time.monotonic() - started, 3), timings={})
        check_reachable(host, port)
        os.makedirs(temp_dir(store), mode=0o755, exist_ok=True)   # Ray's temp, as the machine sees it
        argv = join_argv(driver, head, address, num_gpus, resources, temp)
        write_record(store, role="worker", address=address, port=None, gcs_address=head,
                      started_at=round(time.time(), 3))
        alive, timings = _start_node(driver, store, out, argv, head, address, None)
        write_record(store, node_id=alive["node"]["node_id"])
    return out.result(already_running=False, head=head, address=address, node_id=alive["node"]["node_id"],
                      num_gpus=num_gpus, resources=resources, nodes=alive["nodes"],
                      seconds=round(time.monotonic() - started, 3), timings=timings)


@command("ray", "status", args=[HEAD, STORE])
def cmd_status(args, out) -> int:
    """``ray status --head ADDR:PORT``: the cluster's nodes, as Ray reports them.

    Run it on a node of that cluster (the head): a Ray driver needs a Ray
    node on its own machine.  Result: ``{"head", "nodes": [{"node_id",
    "address", "alive", "gpus"}], "alive_nodes", "gpus" (of the alive
    nodes), "seconds"}``.  Errors: ``unreachable`` (nothing answers at the
    head), ``not_retryable`` (no node of that cluster here), ``retryable``.
    """
    started = time.monotonic()
    host, port = parse_host_port(args.head)
    store = store_dir(args.store)
    driver = runtime.current_driver(store)
    driver.check()
    head = build_address(resolve_head(host), port)
    check_reachable(host, port)
    temp, procs = ray_view(store, driver)
    node = local_node(temp, read_record(store).get("sids", ()), procs)
    if node is None or node["gcs_address"] != head:
        here = "no Ray node runs here" if node is None else "this machine's node belongs to the " \
            "cluster whose head is %s" % node["gcs_address"]
        raise AgentError(NOT_RETRYABLE, "Cannot ask Ray at %s from this machine: %s, and a Ray driver "
                                        "needs a node of its cluster on its machine (ask the head)"
                         % (head, here))
    answer = run_status(driver, head, node_ip=node["node_ip"])
    nodes = sorted(answer["nodes"], key=lambda n: (not n.get("alive"), str(n.get("address")),
                                                   str(n.get("node_id"))))
    return out.result(head=head, nodes=nodes, seconds=round(time.monotonic() - started, 3),
                      **summarize_nodes(nodes))


@command("ray", "stop", args=[STORE])
def cmd_stop(args, out) -> int:
    """``ray stop``: stop this machine's Ray (SIGTERM, raylet first, GCS last; SIGKILL after 2 s).

    Result: ``{"stopped": bool (something was running), "pids", "forced"
    (needed SIGKILL), "seconds"}``.  Running it again is a no-op.
    """
    store = store_dir(args.store)
    return out.result(**stop_locked(store, out, runtime.recorded_driver(store)))


@command("ray", "reach", args=[HEAD])
def cmd_reach(args, out) -> int:
    """``ray reach --head ADDR:PORT``: the head's GCS answers a TCP connect from here.

    Result: ``{"head", "seconds"}``.  Error: ``unreachable``, in words.
    """
    started = time.monotonic()
    host, port = parse_host_port(args.head)
    check_reachable(host, port)
    return out.result(head=build_address(resolve_head(host), port), seconds=round(time.monotonic() - started, 3))

