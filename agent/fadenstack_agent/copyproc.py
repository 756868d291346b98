"""A model's copies on this machine: their records, their engine processes,
starting them detached and stopping them, for ``copy`` and ``runtime stop``.

Under ``<store>/copies/``: ``<id>.json`` (the record, mode 0600: ``{"copy",
"cluster", "driver", "container", "pid", "host_pid", "start_ticks", "port",
"address", "started_at", "argv", "env_names", "spec_digest", "log_path",
"agent_version"}``) and ``.lock``, which the runtime container cannot write (the
store is read-only there); under ``<store>/copies/out/`` (``OUT``, the one part
the container writes): ``<id>.log`` (the engine's output; the previous start's
is ``<id>.log.1``) and ``<id>.pid`` (a container copy's pid as the container
sees it).  The agent reads those two never through a link (``read_tail``) and
only signals that pid inside the container.

A copy is the engine process itself, in a session of its own so that it
outlives the agent and the SSH session that started it:

- ``process``: the configured ``vllm`` executable, started by the agent
  (``start_new_session``, stdin /dev/null, output to the log);
- ``docker`` / ``podman``: ``<engine> exec --detach -e NAME... fadenstack-<cluster>
  sh -c LAUNCH`` where LAUNCH writes its pid (``$$``) to the pid file and
  ``exec``s the engine's argv, given as arguments (never parsed by the shell),
  with its output to the log.  The store is the container's
  ``/var/lib/fadenstack``.  It is signalled inside the container (``exec
  kill``): pids differ there.

``pid`` is the engine's pid where it runs (in the container for a container
copy); ``host_pid`` and ``start_ticks`` are this machine's view of it (from
/proc: the process's start time guards against a reused pid), null when this
machine's /proc cannot tell, and then the container is asked (``kill -0``).
"""

import errno
import os
import signal
import socket
import subprocess
import time

from .containers import STORE_IN_CONTAINER, Engine, engine_environ
from .engines import last_lines, namespace_processes, ray_auth_settings, run_engine
from .engineoutput import is_no_such_container, parse_state
from .files import Locked, read_json, remove_quietly, write_json
from .protocol import ADDRESS_IN_USE, NOT_RETRYABLE, RETRYABLE, AgentError
from .rayproc import machine_processes, read_proc, read_tail

LOCK_WAIT = 60.0
PID_WAIT = 10.0               # a container copy must write its pid file within this
LAUNCH = 'pidfile=$1; log=$2; shift 2; echo $$ > "$pidfile" && exec "$@" >> "$log" 2>&1 < /dev/null'
KILL = 'kill "$@"'               # the shell's own kill: an image need not carry procps
LOG_TAIL = 20
VISIBLE_DEVICES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


# ------------------------------------------------------------------ records


OUT = "out"                      # under copies/: what the engine writes (logs, pid files)


def copies_dir(store: str) -> str:
    return os.path.join(store, "copies")


def out_dir(store: str) -> str:
    return os.path.join(copies_dir(store), OUT)


def record_path(store: str, copy: str) -> str:
    return os.path.join(copies_dir(store), copy + ".json")


def log_path(store: str, copy: str) -> str:
    return os.path.join(out_dir(store), copy + ".log")


def pid_path(store: str, copy: str) -> str:
    return os.path.join(out_dir(store), copy + ".pid")


def in_container(store: str, path: str) -> str:
    """A path under the store as the runtime container sees it."""
    return STORE_IN_CONTAINER + path[len(store):]


def copies_lock(store: str) -> Locked:
    """``with copies_lock(store):`` one copy-changing command at a time on a machine."""
    return Locked(os.path.join(copies_dir(store), ".lock"), LOCK_WAIT,
                  "another copy command has been running on this machine for %d s" % LOCK_WAIT)


def read_record(store: str, copy: str) -> dict:
    return read_json(record_path(store, copy)) or {}


def read_records(store: str) -> list:
    try:
        names = sorted(os.listdir(copies_dir(store)))
    except OSError:
        return []
    records = [read_json(os.path.join(copies_dir(store), name)) for name in names
               if name.endswith(".json") and not name.startswith(".")]
    return [record for record in records if record and isinstance(record.get("copy"), str)]


def write_record(store: str, record: dict) -> None:
    write_json(record_path(store, record["copy"]), record, mode=0o600)


def remove_record(store: str, copy: str) -> None:
    remove_quietly(record_path(store, copy))
    remove_quietly(pid_path(store, copy))


def log_tail(store: str, copy: str, lines: int = LOG_TAIL) -> list:
    """The last ``lines`` lines of the copy's log (the engine's own words)."""
    text = read_tail(log_path(store, copy), max(65536, lines * 400))
    return [line.rstrip() for line in text.splitlines()[-lines:]]


# ------------------------------------------------------------------ processes


def ns_pid(host_pid: int):
    """The pid a process has in its own (innermost) pid namespace, from /proc."""
    try:
        with open("/proc/%d/status" % host_pid) as fh:
            for line in fh:
                if line.startswith("NSpid:"):
                    return int(line.split()[-1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def container_state(engine: Engine, cluster: str):
    """The runtime container's state (``parse_state``), or None when it is absent."""
    code, stdout, stderr = run_engine(engine.inspect_argv(cluster))
    if code != 0:
        if is_no_such_container(stderr + stdout):
            return None
        raise AgentError(RETRYABLE, "%s cannot tell the state of the runtime container: %s"
                         % (engine.name, last_lines(stderr + stdout)))
    return parse_state(stdout)


def in_namespace(init_pid, pid: int):
    """The container's process of pid ``pid`` (as the container sees it), by this machine's /proc."""
    for proc in namespace_processes(init_pid) if init_pid else []:
        if ns_pid(proc.pid) == pid:
            return proc
    return None


def is_running(record: dict, config: dict) -> bool:
    """The copy's engine process is alive (not a zombie, not another process under its pid)."""
    if record.get("host_pid"):
        proc = read_proc(record["host_pid"])
        return proc is not None and proc.start == record.get("start_ticks")
    if record.get("driver") in ("docker", "podman") and record.get("pid"):
        engine = Engine.from_config(record["driver"], config)
        return run_engine(engine.exec_argv(record["cluster"], ["sh", "-c", KILL, "kill", "-0", str(record["pid"])]))[0] == 0
    return False


def descendants(root: int, procs: list) -> list:
    """The processes under ``root`` (by this machine's pids), children first found first."""
    children, found, todo = {}, [], [root]
    for proc in procs:
        children.setdefault(proc.ppid, []).append(proc)
    while todo:
        for proc in children.get(todo.pop(), []):
            found.append(proc)
            todo.append(proc.pid)
    return found


# ------------------------------------------------------------------ starting


def check_port(store: str, address: str, port: int) -> None:
    """The engine can bind ``address:port`` now (else ``address_in_use``, naming our copy that holds it)."""
    sock = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as the engine's server does
    try:
        sock.bind((address, port))
    except OSError as exc:
        words = exc.strerror or str(exc)
        if exc.errno == errno.EADDRINUSE:
            holders = [r["copy"] for r in read_records(store) if r.get("port") == port and r.get("address") == address]
            held = " (held by copy %s)" % holders[0] if holders else ""
            raise AgentError(ADDRESS_IN_USE, "Port %d on %s is in use%s: %s" % (port, address, held, words))
        if exc.errno == errno.EADDRNOTAVAIL:
            raise AgentError(NOT_RETRYABLE, "%s is not an address of this machine (%s)" % (address, words))
        raise AgentError(RETRYABLE, "Cannot check port %d on %s: %s" % (port, address, words))
    finally:
        sock.close()


def _rotate_log(store: str, copy: str) -> str:
    path = log_path(store, copy)
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if os.path.lexists(path):
        os.replace(path, path + ".1")     # a link is renamed, never followed
    return path


def _open_log(path: str):
    """The fresh log, made by the agent (never through a link planted where the container writes)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "ab")


def launch_process(store: str, copy: str, argv: list, values: dict) -> dict:
    """Start the engine on this machine, detached: ``{"pid", "host_pid", "start_ticks"}``.  Its
    environment is the agent's with ``values``; the GPUs it sees are only those ``values`` name."""
    environ = {name: value for name, value in os.environ.items() if name not in VISIBLE_DEVICES}
    environ.update(values)
    with _open_log(_rotate_log(store, copy)) as log:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd="/",
                                    env=environ, start_new_session=True, close_fds=True)
        except OSError as exc:
            raise AgentError(NOT_RETRYABLE, "Cannot run the engine %s on this machine: %s"
                             % (argv[0], exc.strerror or exc))
    seen = read_proc(proc.pid)
    return {"pid": proc.pid, "host_pid": proc.pid, "start_ticks": seen.start if seen else None}


def launch_argv(store: str, copy: str, engine: Engine, cluster: str, argv: list, names) -> list:
    """``<engine> exec --detach -e NAME... fadenstack-<cluster> sh -c LAUNCH ... argv``: the engine's
    argv as arguments of the shell, which writes its pid and becomes the engine."""
    command = ["sh", "-c", LAUNCH, "fadenstack-copy", in_container(store, pid_path(store, copy)),
               in_container(store, log_path(store, copy))] + list(argv)
    return engine.exec_argv(cluster, command, sorted(names), detach=True, settings=ray_auth_settings(cluster))


def launch_in_container(store: str, copy: str, engine: Engine, cluster: str, argv: list, values: dict) -> dict:
    """Start the engine in the cluster's container with ``exec --detach``; its pid from the pid file.
    ``values`` reach it by name (``-e NAME``) from the engine's environment, never on a command line."""
    pidfile = pid_path(store, copy)
    remove_quietly(pidfile)
    _open_log(_rotate_log(store, copy)).close()
    exec_argv = launch_argv(store, copy, engine, cluster, argv, values)
    try:
        done = subprocess.run(exec_argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=engine_environ(values), cwd="/", timeout=60)
    except (FileNotFoundError, PermissionError) as exc:
        raise AgentError(NOT_RETRYABLE, "Cannot run %s on this machine: %s" % (engine.name, exc.strerror or exc))
    except subprocess.TimeoutExpired:
        raise AgentError(RETRYABLE, "%s exec did not return within 60 s" % engine.name)
    if done.returncode != 0:
        words = (done.stderr + done.stdout).decode("utf-8", "replace")
        raise AgentError(NOT_RETRYABLE, "%s could not start the engine in the runtime container: %s"
                         % (engine.name, last_lines(words)))
    deadline = time.monotonic() + PID_WAIT
    while True:
        text = read_tail(pidfile, 64)
        if text.endswith("\n") and text.strip().isdigit():
            break
        if time.monotonic() > deadline:
            raise AgentError(RETRYABLE, "The engine started in the runtime container wrote no pid within %d s; "
                                        "its log: %s" % (PID_WAIT, last_lines("\n".join(log_tail(store, copy)))))
        time.sleep(0.02)
    pid = int(text.strip())
    state = container_state(engine, cluster)
    proc = in_namespace(state and state["pid"], pid)
    return {"pid": pid, "host_pid": proc.pid if proc else None, "start_ticks": proc.start if proc else None}


# ------------------------------------------------------------------ stopping


def _signal(record: dict, config: dict, sig, pids: list) -> None:
    """Send ``sig`` to ``pids`` (as the copy's driver sees them): in the container through ``exec kill``."""
    if record.get("driver") in ("docker", "podman"):
        engine = Engine.from_config(record["driver"], config)
        run_engine(engine.exec_argv(record["cluster"], ["sh", "-c", KILL, "kill", "-%d" % sig] + [str(p) for p in pids]))
        return
    for pid in pids:
        try:
            if pid == record.get("host_pid") and os.getpgid(pid) == pid and not record.get("ray"):
                os.killpg(pid, sig)     # the engine's session: its workers too
            # A copy's Ray node (``ray start --block``) drains and ends its own processes on SIGTERM; with
            # them signalled at once, it would wait out its 30 s drain for a raylet already gone.
            else:
                os.kill(pid, sig)
        except OSError:
            pass


def _tree(record: dict, config: dict) -> list:
    """The copy's processes under the engine (this machine's view), for a last SIGKILL."""
    if not record.get("host_pid"):
        return []
    if record.get("driver") in ("docker", "podman"):
        state = container_state(Engine.from_config(record["driver"], config), record["cluster"])
        procs = namespace_processes(state["pid"]) if state and state["pid"] else []
    else:
        procs = machine_processes()
    return descendants(record["host_pid"], procs)


def _alive(proc) -> bool:
    now = read_proc(proc.pid)
    return now is not None and now.start == proc.start


def _wait_gone(record: dict, config: dict, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while is_running(record, config):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05 if record.get("host_pid") else 0.25)
    return True


def stop_copy(record: dict, config: dict, timeout: float, out=None) -> dict:
    """SIGTERM the engine, wait ``timeout`` s, then SIGKILL it and what it started:
    ``{"copy", "was_running", "forced", "seconds"}``."""
    started = time.monotonic()
    if not is_running(record, config):
        return {"copy": record["copy"], "was_running": False, "forced": False, "seconds": 0.0}
    tree = _tree(record, config)
    inner = record["pid"]
    if out is not None:
        out.log("stopping copy %s (pid %s)" % (record["copy"], inner))
    _signal(record, config, signal.SIGTERM, [inner])
    forced = not _wait_gone(record, config, timeout)
    leftover = [p for p in tree if _alive(p)]
    if forced or leftover:
        if out is not None:
            out.log("copy %s did not end within %g s: SIGKILL" % (record["copy"], timeout) if forced
                    else "copy %s left %d process(es): SIGKILL" % (record["copy"], len(leftover)))
        container = record.get("driver") in ("docker", "podman")
        pids = ([inner] if forced else []) + [ns_pid(p.pid) if container else p.pid for p in leftover]
        _signal(record, config, signal.SIGKILL, [p for p in pids if p])
        _wait_gone(record, config, 5.0)
    return {"copy": record["copy"], "was_running": True, "forced": forced,
            "seconds": round(time.monotonic() - started, 3)}


def stop_all(store: str, config: dict, container_gone: bool, out=None) -> list:
    """For ``runtime stop``: end every copy of the runtime and clear their records.  With
    ``container_gone`` the container's removal ended them; the ``process`` driver's are stopped."""
    stopped = []
    with copies_lock(store):
        for record in read_records(store):
            if record.get("driver") == "process" or not container_gone:
                stopped.append(stop_copy(record, config, 10.0, out)["copy"])
            else:
                stopped.append(record["copy"])
            remove_record(store, record["copy"])
    return stopped
