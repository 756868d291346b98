"""``copy start|stop|list|logs``: a model's copies, each an inference engine
(vLLM's OpenAI-compatible server) run in the cluster's runtime.

The console builds the engine's command line and places the copy (its GPUs,
its port on the machine's cluster address); the agent checks the spec, starts
the engine detached in the runtime the machine started (``runtime start``:
the container ``fadenstack-<cluster>`` with Docker or Podman, or the lab's
``process`` driver), records it, and later lists, stops and reads it.  The
processes and records are ``copyproc``'s.

The spec arrives on stdin, never on the command line (argv stays short and
free of secrets)::

    {"copy": "d7-c3", "cluster": "gpu-room", "argv": ["vllm", "serve", "/var/lib/fadenstack/models/...",
     "--host", "198.18.1.11", "--port", "8100", ...], "env": {"CUDA_VISIBLE_DEVICES": "0,1"},
     "port": 8100, "address": "198.18.1.11"}

A copy over several machines also runs a Ray of its own, a node per machine:
a spec with ``ray`` instead of ``argv`` (see ``copyray``).

The machine config's ``engine_env`` (``{"NAME": "value"}``) goes to every copy
this machine starts, under the spec's ``env`` (which wins on a clash): the
machine's own settings for its engines, such as NCCL's interface or
``HF_HUB_OFFLINE``, and in the lab the engine's pace.  With the ``process``
driver the machine config names the engine executable (``"process": {"vllm":
"/path/to/vllm"}``), which stands for the argv's ``vllm``.
"""

import concurrent.futures
import hashlib
import http.client
import ipaddress
import json
import os
import re
import ssl
import time

from . import copyproc, copyray, get_version
from .blobspec import read_spec
from .cli import STORE, arg, command, group, seconds_arg
from .containers import CLUSTER_RE, ENV_NAME_RE
from .engines import last_lines
from .files import load_machine_config, store_dir
from .protocol import ADDRESS_IN_USE, BAD_INPUT, NOT_RETRYABLE, AgentError
from .runtime import read_state, recorded_driver
from .copytls import client_context as _client_context, tls_argv, uses_tls  # noqa: F401 (tls_argv: the spec's)
from .tlsfiles import ray_tls_environ

COPY_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$")
ENGINES = ("vllm",)              # argv[0]: the only engine binary
ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "RAY_ADDRESS", "HF_HUB_OFFLINE",
             "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "OMP_NUM_THREADS", "PYTORCH_CUDA_ALLOC_CONF")
ENV_PREFIXES = ("VLLM_", "NCCL_")
MAX_ARGS, MAX_ARG, MAX_VALUE = 512, 16384, 4096
SETTLE = 1.5                     # an engine that refuses its argv or model does so within this
HEALTH_TIMEOUT = 1.0
# A copy behind mutual TLS (the console's ``--ssl-*`` flags): its files as the runtime container sees the
# cluster's directory; the ``process`` runtime gets this machine's paths in their place.
SPEC_SHAPE = ('{"copy": "d7-c3", "cluster": "NAME", "argv": ["vllm", "serve", ...], "env": {"CUDA_VISIBLE_DEVICES": '
              '"0"}, "port": 8100, "address": "198.18.1.11"}')
COPY = arg("--copy", required=True, metavar="ID", help="the copy's id (as in copy start's spec)")

group("copy", help="a model's copies: inference engines in the cluster's runtime")


# ------------------------------------------------------------------ the spec


def check_copy_id(copy) -> str:
    if not isinstance(copy, str) or not COPY_RE.match(copy):
        raise AgentError(BAD_INPUT, "the copy id must be 1 to 64 lowercase letters, digits and dashes, not starting "
                                    "or ending with a dash, got %s" % json.dumps(copy)[:80])
    return copy


def allowed_env_name(name: str) -> bool:
    return name in ENV_NAMES or (name.startswith(ENV_PREFIXES) and bool(ENV_NAME_RE.match(name)))


def _flag(argv: list, name: str):
    """The value of ``--name V`` or ``--name=V`` in an argv (the last one given), or None."""
    value = None
    for i, word in enumerate(argv):
        if word == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif word.startswith(name + "="):
            value = word[len(name) + 1:]
    return value


def check_spec(spec) -> dict:
    """The spec from stdin, every field checked (``bad_input`` saying which and why)."""
    if not isinstance(spec, dict):
        raise AgentError(BAD_INPUT, "the copy spec on stdin must be one JSON object %s" % SPEC_SHAPE)
    unknown = sorted(set(spec) - {"copy", "cluster", "argv", "env", "port", "address", "ray"})
    if unknown:
        raise AgentError(BAD_INPUT, "the copy spec has unknown keys: %s" % ", ".join(unknown))
    copy = check_copy_id(spec.get("copy"))
    cluster = spec.get("cluster")
    if not isinstance(cluster, str) or not CLUSTER_RE.match(cluster):
        raise AgentError(BAD_INPUT, "the cluster must be 1 to 63 lowercase letters, digits and dashes, not starting "
                                    "or ending with a dash, got %s" % json.dumps(cluster)[:80])
    env = _check_env(spec.get("env", {}))
    address = _check_address(spec.get("address"))
    if "ray" in spec:
        if "argv" in spec or "port" in spec:
            raise AgentError(BAD_INPUT, "a copy's Ray node has ray, not argv or port: its command and ports are the "
                                        "agent's to choose")
        return {"copy": copy, "cluster": cluster, "ray": copyray.check_ray(spec["ray"], env, copy), "env": env,
                "address": address}
    argv = spec.get("argv")
    if not isinstance(argv, list) or not 2 <= len(argv) <= MAX_ARGS:
        raise AgentError(BAD_INPUT, "argv must be a list of 2 to %d strings, the engine's command line" % MAX_ARGS)
    for i, word in enumerate(argv):
        if not isinstance(word, str) or "\0" in word or len(word) > MAX_ARG:
            raise AgentError(BAD_INPUT, "argv[%d] must be a string of at most %d characters without NUL, got %s"
                             % (i, MAX_ARG, json.dumps(word)[:80]))
    if argv[0] not in ENGINES:
        raise AgentError(BAD_INPUT, "argv[0] must be the engine %s, got %s" % (" or ".join(ENGINES), json.dumps(argv[0])[:80]))
    port = spec.get("port")
    if isinstance(port, bool) or not isinstance(port, int) or not 1024 <= port <= 65535:
        raise AgentError(BAD_INPUT, "port must be a whole number from 1024 to 65535, got %s" % json.dumps(port)[:40])
    for flag, want in (("--port", str(port)), ("--host", address)):
        given = _flag(argv, flag)
        if given != want:
            raise AgentError(BAD_INPUT, "argv must bind the engine where the spec says: %s %s, not %s"
                             % (flag, want, "no " + flag if given is None else given))
    return {"copy": copy, "cluster": cluster, "argv": list(argv), "env": env, "port": port, "address": address}


def _check_env(env) -> dict:
    if not isinstance(env, dict):
        raise AgentError(BAD_INPUT, "env must be an object of variable names and values")
    for name, value in sorted(env.items()):
        if not allowed_env_name(name):
            raise AgentError(BAD_INPUT, "the variable %s is not one a copy may be given (allowed: %s and names "
                                        "starting %s)" % (json.dumps(name)[:80], ", ".join(ENV_NAMES),
                                                          " or ".join(ENV_PREFIXES)))
        if not isinstance(value, str) or "\0" in value or len(value) > MAX_VALUE:
            raise AgentError(BAD_INPUT, "the value of %s must be a string of at most %d characters without NUL"
                             % (name, MAX_VALUE))
    return dict(env)


def _check_address(value) -> str:
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise AgentError(BAD_INPUT, "address must be an IP address of this machine, got %s" % json.dumps(value)[:80])


def read_copy_spec() -> dict:
    try:
        raw = read_spec(noun="copy")
    except AgentError:
        raise AgentError(BAD_INPUT, "no copy spec arrived on stdin: send one JSON object %s" % SPEC_SHAPE)
    try:
        spec = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise AgentError(BAD_INPUT, "the copy spec on stdin is not valid JSON: %s" % exc)
    return check_spec(spec)


def spec_digest(spec: dict) -> str:
    """What tells two starts of one copy apart: the console's spec, values included (the record keeps
    only this of them).  The machine's ``engine_env`` is not part of it."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# ------------------------------------------------------------------ the machine's side


def engine_env(config: dict) -> dict:
    """A copy over several machines also runs a Ray of its own, a node per machine:
a spec with ``ray`` instead of ``argv`` (see ``copyray``).

The machine config's ``engine_env``: variables every copy gets."""
    values = config.get("engine_env") or {}
    if not isinstance(values, dict) or not all(
            isinstance(k, str) and ENV_NAME_RE.match(k) and isinstance(v, str) and "\0" not in v
            for k, v in values.items()):
        raise AgentError(NOT_RETRYABLE, "The machine config's engine_env must be an object of variable names and "
                                        "text values, got %s" % json.dumps(values)[:200])
    return dict(values)


def process_engine(config: dict) -> str:
    """The ``process`` driver's engine executable (the machine config's ``process.vllm``)."""
    path = (config.get("process") or {}).get("vllm")
    if not isinstance(path, str) or not os.path.isabs(path):
        raise AgentError(NOT_RETRYABLE, "The runtime driver is \"process\", but the machine config's \"process\".vllm "
                                        "does not name the engine executable by its absolute path (got %r)" % (path,))
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise AgentError(NOT_RETRYABLE, "The process runtime's engine %s is not an executable file on this machine" % path)
    return path


def runtime_driver(store: str, config: dict, cluster: str):
    """The started runtime's driver, which must be the cluster's (``not_retryable`` otherwise)."""
    state = read_state(store)
    if state.get("state") != "started":
        raise AgentError(NOT_RETRYABLE, "The runtime is not started on this machine: a copy runs in the cluster's "
                                        "runtime (`runtime start` first)")
    driver = recorded_driver(store, config)
    if driver.per_cluster:
        if state.get("cluster") != cluster:
            raise AgentError(NOT_RETRYABLE, "The runtime on this machine is cluster %s's, not %s's"
                             % (state.get("cluster"), cluster))
        container = copyproc.container_state(driver.engine, cluster)
        if not container or not container["running"]:
            raise AgentError(NOT_RETRYABLE, "The runtime container %s is %s: start the runtime again before its copies"
                             % (driver.container, container["status"] if container else "absent"))
    return driver


def healthy(record: dict) -> bool:
    """``GET /health`` answered 200 within HEALTH_TIMEOUT, asked directly (a machine's proxy
    variables, meant for downloads, must not carry it); over mutual TLS for a copy behind it.  A copy's
    Ray node: its head's GCS accepts a connection; a node joining it, that it runs."""
    if copyray.is_piece(record):
        return copyray.answers(record["address"], record["port"]) if record.get("port") else True
    if uses_tls(record):
        try:
            context = _client_context(record["cluster"])
        except (OSError, ssl.SSLError, AgentError):
            return False
        conn = http.client.HTTPSConnection(record["address"], record["port"], timeout=HEALTH_TIMEOUT, context=context)
    else:
        conn = http.client.HTTPConnection(record["address"], record["port"], timeout=HEALTH_TIMEOUT)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


VISIBLE = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


def visible_gpus(env: dict):
    """The GPU indices a copy's environment shows its engine (the first of the vendors' variables that is
    set), or None when none is: what ``copy list`` reports, so that the console can tell which GPUs an
    engine holds even when no record of its own knows the engine any more."""
    for name in VISIBLE:
        value = env.get(name)
        if value is not None:
            try:
                return [int(word) for word in str(value).split(",") if word.strip()]
            except ValueError:
                return None
    return None


def view(store: str, record: dict, config: dict) -> dict:
    """A record as ``copy list`` shows it: running, healthy, and the log's last lines unless healthy."""
    running = copyproc.is_running(record, config)
    good = running and healthy(record)
    shown = {key: record.get(key) for key in ("copy", "cluster", "driver", "container", "pid", "host_pid", "port",
                                               "address", "started_at", "argv", "env_names", "gpus")}
    return dict(shown, running=running, healthy=good,
                log=None if good else last_lines("\n".join(copyproc.log_tail(store, record["copy"])), 20, 4000))


def settle(store: str, record: dict, config: dict) -> None:
    """Wait until the engine answers /health or SETTLE s pass; an engine that ended meanwhile
    refused its start: its own words, ``address_in_use`` when its port was taken."""
    deadline = time.monotonic() + SETTLE
    while time.monotonic() < deadline:
        if not copyproc.is_running(record, config):
            words = last_lines("\n".join(copyproc.log_tail(store, record["copy"])), 10, 4000)
            kind = ADDRESS_IN_USE if "address already in use" in words.lower() else NOT_RETRYABLE
            raise AgentError(kind, "The engine of copy %s ended right after it started; its last lines: %s"
                             % (record["copy"], words))
        if healthy(record):
            return
        time.sleep(0.1)


# ------------------------------------------------------------------ commands


@command("copy", "start", args=[STORE])
def cmd_start(args, out) -> int:
    """``copy start [--store PATH]`` with the copy's spec on stdin: start the engine detached in the runtime.

    Stdin: ``{"copy", "cluster", "argv": ["vllm", ...], "env", "port", "address"}``, or for a spanning
    copy's Ray node ``{"copy": "<copy>-ray", "cluster", "ray": {"head", "gpus"}, "env", "address"}``
    (``copyray``: its ``port`` in the result is the head's GCS port).  Result: the record
    (``{"copy", "cluster", "driver", "container", "pid", "host_pid", "start_ticks", "port", "address",
    "started_at", "argv", "env_names", "spec_digest", "log_path", "agent_version"}``) with ``"running"`` and ``"already"``
    (the same spec already runs: nothing started).  A bad spec is ``bad_input``; the port taken on
    the address ``address_in_use``; another spec running under the id, no runtime started, an address
    not this machine's or an engine that ends at once (its last lines) ``not_retryable``.
    """
    spec = read_copy_spec()
    store = store_dir(args.store)
    config = load_machine_config()
    values = dict(engine_env(config), **spec["env"])
    driver = runtime_driver(store, config, spec["cluster"])
    # A spanning copy's own Ray, and the engine that drives it, use TLS as the cluster's Ray does (``tlsfiles``).
    values.update(ray_tls_environ(spec["cluster"], in_container=driver.per_cluster))
    piece = copyray.is_piece(spec)
    executable = None if driver.per_cluster or piece else process_engine(config)
    digest = spec_digest(spec)
    with copyproc.copies_lock(store):
        record = copyproc.read_record(store, spec["copy"])
        if record and copyproc.is_running(record, config):
            if record.get("spec_digest") == digest:
                return out.result(**dict(record, running=True, already=True))
            raise AgentError(NOT_RETRYABLE, "Copy %s already runs on this machine with another spec (pid %s, port %s): "
                                            "`copy stop --copy %s` first" % (spec["copy"], record.get("pid"),
                                                                             record.get("port"), spec["copy"]))
        os.makedirs(copyproc.copies_dir(store), mode=0o755, exist_ok=True)
        if piece:
            port, argv = copyray.node_command(store, spec, driver, values)   # values: the node's pinned metrics ports
        else:
            copyproc.check_port(store, spec["address"], spec["port"])
            port, argv = spec["port"], tls_argv(spec["argv"], spec["cluster"], driver.per_cluster)
        if driver.per_cluster:
            out.log("starting copy %s in %s: %s" % (spec["copy"], driver.container, " ".join(argv)))
            started = copyproc.launch_in_container(store, spec["copy"], driver.engine, spec["cluster"], argv, values)
        else:
            run = argv if piece else [executable] + argv[1:]
            out.log("starting copy %s: %s" % (spec["copy"], " ".join(run)))
            started = copyproc.launch_process(store, spec["copy"], run, values)
        record = dict(started, copy=spec["copy"], cluster=spec["cluster"], driver=driver.name,
                      container=driver.container if driver.per_cluster else None, port=port,
                      address=spec["address"], started_at=round(time.time(), 3), argv=argv, ray=spec.get("ray"),
                      env_names=sorted(values), gpus=visible_gpus(spec["env"]), spec_digest=digest, log_path=copyproc.log_path(store, spec["copy"]),
                      agent_version=get_version())
        copyproc.write_record(store, record)
        settle(store, record, config)
    return out.result(**dict(record, running=True, already=False))


@command("copy", "stop", args=[STORE, COPY, arg("--timeout", type=seconds_arg(0, 600), default=30.0,
                                                  help="seconds from SIGTERM to SIGKILL (default 30)")])
def cmd_stop(args, out) -> int:
    """``copy stop --copy ID [--timeout S] [--store PATH]``: SIGTERM the engine, SIGKILL it after S seconds.

    In a container the signals are sent inside it (its pids are not this machine's).  The record goes;
    the log stays.  Stopping a stopped or unknown copy succeeds.  Result: ``{"copy", "stopped": bool
    (a running engine was stopped), "forced": bool (it took SIGKILL), "seconds"}``.
    """
    copy = check_copy_id(args.copy)
    store = store_dir(args.store)
    config = load_machine_config()
    with copyproc.copies_lock(store):
        record = copyproc.read_record(store, copy)
        if not record:
            return out.result(copy=copy, stopped=False, forced=False, seconds=0.0)
        done = copyproc.stop_copy(record, config, args.timeout, out)
        copyproc.remove_record(store, copy)
    return out.result(copy=copy, stopped=done["was_running"], forced=done["forced"], seconds=done["seconds"])


@command("copy", "list", args=[STORE])
def cmd_list(args, out) -> int:
    """``copy list [--store PATH]``: every recorded copy, whether its engine runs and answers.

    Result: ``{"store", "copies": [{"copy", "cluster", "driver", "container", "pid", "host_pid", "port",
    "address", "started_at", "argv", "env_names", "gpus" (the GPU indices its environment shows it, null
    when none or for a copy started by an older agent), "running", "healthy" (GET /health answered 200 within
    1 s), "log": the log's last lines unless healthy, else null}]}``.
    """
    store = store_dir(args.store)
    config = load_machine_config()
    records = copyproc.read_records(store)
    with concurrent.futures.ThreadPoolExecutor(max(1, min(16, len(records)))) as pool:
        copies = list(pool.map(lambda record: view(store, record, config), records))
    return out.result(store=store, copies=copies)


@command("copy", "logs", args=[STORE, COPY, arg("--lines", type=int, default=50, metavar="N",
                                                  help="how many of the last lines (default 50, at most 10000)")])
def cmd_logs(args, out) -> int:
    """``copy logs --copy ID [--lines N] [--store PATH]``: the last lines of the copy's engine log.

    Result: ``{"copy", "lines": [...], "path", "running"}``.  No log of that copy here: ``not_retryable``.
    """
    copy = check_copy_id(args.copy)
    if not 1 <= args.lines <= 10000:
        raise AgentError(BAD_INPUT, "--lines must be from 1 to 10000, got %d" % args.lines)
    store = store_dir(args.store)
    path = copyproc.log_path(store, copy)
    if not os.path.exists(path):
        raise AgentError(NOT_RETRYABLE, "No log of copy %s on this machine (never started here, or its store was "
                                        "cleared)" % copy)
    record = copyproc.read_record(store, copy)
    running = bool(record) and copyproc.is_running(record, load_machine_config())
    return out.result(copy=copy, lines=copyproc.log_tail(store, copy, args.lines), path=path, running=running)
