"""``allreduce run|exec``: the NCCL test, nccl-tests' ``all_reduce_perf`` across the cluster's nodes.

nccl-tests spans machines only under MPI (without it, it is one process on one node: NVIDIA's answer
in nccl-tests issue #121), so the head runs Open MPI's ``mpirun`` inside its runtime container, one
process per GPU with ``-g 1``, which serves nodes of different GPU counts (``allreducespec.mpirun_argv``,
a pure function of the spec, as everything built from it is)::

    mpirun --allow-run-as-root --leave-session-attached --host ADDR:G,ADDR:G,... -np <all GPUs>
           --map-by slot --bind-to none --mca plm_rsh_agent "python3 /tmp/fadenstack-allreduce/launch"
           --mca plm_rsh_no_tree_spawn 1 -x FADEN_ALLREDUCE_NODES=ADDR,... -x FADEN_ALLREDUCE_SLOTS=G,...
           all_reduce_perf -b MIN -e MAX -f 2 -g 1 -n ITERS -w WARMUP -c 1

The runtime is not trusted with anything of the machine's (issue 27: code in the container must not
get root on the hosts). The cluster's root SSH key never enters it, and the agent follows, runs or
believes nothing the runtime can write: no file of the run is in the store. What the runtime needs
(the launcher, the pid files) is written *inside* it through the engine's ``exec`` (``Runtime``), so
a link planted there resolves in the container; the agent's own files for the run (its record, the
run's SSH config) are in ``<agent home>/allreduce/``, a directory only root owns, outside every mount,
written with ``O_NOFOLLOW`` into a fresh name and renamed (``private``).

mpirun calls the launcher for every other node with the address and its daemon's (``orted``'s)
command line; the launcher holds no key: it asks this agent over the run's socket
(``allreducelaunch``: an abstract Unix socket, callers checked by ``SO_PEERCRED``), and the agent, on
the machine, reaches the node over the cluster's own SSH (root's key where ``node files write`` put
it, never copied) and has that node's agent run the command line in its own runtime: ``allreduce
exec``, which stays, watching its SSH session. ``orted`` then starts the node's ``all_reduce_perf``;
its output travels back to mpirun, which prints rank 0's table.

Every line mpirun prints on stdout is a progress event ``{"line": ...}`` as it comes; stderr's last
lines come in the result. The timeout, or the console going away (its SSH channel closed: stdout's
reader is gone, which is how the console aborts), ends the run: mpirun gets SIGTERM, on which it ends
every rank and every node's orted itself. Open MPI does not promise that much for a mpirun killed
outright (tried: a SIGKILLed mpirun leaves its own ranks and, daemonized, the nodes' orteds running),
so the run's process tree is taken before the SIGTERM and whatever of it is left after ``KILL_GRACE``
s gets SIGKILL (``proctree``: mpirun, the head's ranks, the launchers), and the agent ends the SSH
sessions it opened, whose closing makes each node's ``allreduce exec`` end its own tree. One run at a
time per machine (a lock file). With the ``process`` driver (the lab's) the same commands run on the
machine itself, their files in the private directory.
"""

import collections
import json
import os
import select
import shutil
import signal
import subprocess
import threading
import time

from .blobspec import read_spec
from .cli import STORE, arg, command, group
from .allreducelaunch import LaunchServer, read_private, remove_quietly, socket_name, write_private
from .allreducespec import (LAUNCHER_PYTHON, MPIRUN, check_spec, kill_argv, launcher_text, mpirun_argv,
                            node_env, pid_wrapped, remote_agent_argv, run_ssh_config, ssh_argv)
from .containers import engine_environ
from .files import agent_home, running_zip, source_root, store_dir, try_lock, unlock
from .nodeedit import Root, block_body, decode
from .nodefiles import KEY_NAME, KNOWN_HOSTS, SSH_BEGIN, SSH_END, root_home
from .proctree import kill_left, snapshot
from .protocol import BAD_INPUT, NOT_RETRYABLE, RETRYABLE, AgentError
from .allreduceruntime import Runtime

KILL_GRACE = 10.0                  # SIGTERM to mpirun -> SIGKILL
STDERR_LINES = 60
LOCK_BUSY = "An NCCL test (allreduce run) is already running on this machine"

group("allreduce", help="the NCCL test: nccl-tests' all_reduce_perf across the cluster's nodes under mpirun")


# ------------------------------------------------------------------ the run


class Run:
    """mpirun, started, read line by line, and ended when told (timeout, console gone)."""

    def __init__(self, runtime: Runtime, argv: list, env: dict):
        self.runtime = runtime
        command = pid_wrapped(argv, runtime.dir_inside + "/mpirun.pid")
        environ = engine_environ(env)
        try:
            self.proc = subprocess.Popen(runtime.argv(command, sorted(env)), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environ, cwd="/",
                                         start_new_session=True)
        except OSError as exc:
            raise AgentError(NOT_RETRYABLE, "Cannot run %s on this machine: %s"
                             % (runtime.argv(command)[0], exc.strerror or exc))
        self.stderr = collections.deque(maxlen=STDERR_LINES)
        self.reader = threading.Thread(target=self._read_stderr, daemon=True)
        self.reader.start()

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.strip():
                self.stderr.append(line)

    def stream(self, deadline: float, gone, on_line):
        """Hand each stdout line to ``on_line`` as it comes, until mpirun closes its output (None) or
        the run must end: ``"timeout"`` at the deadline, ``"gone"`` when ``gone()`` says so (asked
        twice a second)."""
        buffer, fd = b"", self.proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            if gone():
                return "gone"
            if not select.select([fd], [], [], min(0.5, left))[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                if buffer:
                    on_line(buffer.decode("utf-8", "replace"))
                return None
            buffer += chunk
            *whole, buffer = buffer.split(b"\n")
            for line in whole:
                on_line(line.decode("utf-8", "replace"))

    def end(self) -> bool:
        """SIGTERM to mpirun, which ends every rank and every node's daemon; SIGKILL to whatever of the
        run outlives it by the grace (all of it, when mpirun hangs: its tree as it stood, the launchers'
        launchers with it, whose launches the agent then ends). True when something had to be killed."""
        taken = snapshot(self.runtime.root_pid(self.proc, "mpirun.pid") or self.proc.pid)
        self._signal("TERM")
        ended = self._ended(KILL_GRACE)
        killed = kill_left(taken)
        if not ended and not self._ended(KILL_GRACE / 2):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine's client, when the engine does not answer
            self.proc.wait()
        return bool(killed)

    def _ended(self, seconds: float) -> bool:
        try:
            self.proc.wait(seconds)
            return True
        except subprocess.TimeoutExpired:
            return False

    def _signal(self, name: str) -> None:
        """To mpirun: inside a container by its pid there (its engine's client would die alone, and
        mpirun live on), else by ours."""
        if self.runtime.in_container:
            try:
                subprocess.run(self.runtime.argv(kill_argv(name, self.runtime.dir_inside + "/mpirun.pid")),
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
            return
        try:
            os.kill(self.proc.pid, getattr(signal, "SIG" + name))
        except ProcessLookupError:
            pass

    def wait(self) -> int:
        code = self.proc.wait()
        self.reader.join(5)
        return 128 - code if code < 0 else code


def reader_gone(fd: int = 1) -> bool:
    """Whether whoever reads our stdout has gone (the console closed its SSH channel): a pipe or
    socket whose other end is closed polls as an error or hang-up."""
    poller = select.poll()
    poller.register(fd, 0)
    return any(events & (select.POLLERR | select.POLLHUP | select.POLLNVAL) for _, events in poller.poll(0))


def _lock(runtime: Runtime):
    """The machine's one run: the lock's fd, or ``retryable`` naming the run that holds it."""
    path = os.path.join(agent_home(), "allreduce.lock")
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    fd = try_lock(path)
    if fd is None:
        try:
            held = json.loads((read_private(os.path.join(runtime.dir, "run.json")) or b"{}").decode())
        except (UnicodeDecodeError, ValueError):
            held = {}
        held = held if isinstance(held, dict) else {}
        since = time.strftime("%H:%M UTC", time.gmtime(held["started_at"])) if held.get("started_at") else "?"
        raise AgentError(RETRYABLE, "%s: cluster %s's, started at %s (pid %s)"
                         % (LOCK_BUSY, held.get("cluster", "?"), since, held.get("pid", "?")))
    return fd


def _read_stdin_spec() -> dict:
    raw = read_spec(noun="allreduce")
    try:
        return check_spec(json.loads(raw.decode("utf-8")))
    except (UnicodeDecodeError, ValueError) as exc:
        raise AgentError(BAD_INPUT, "the allreduce spec on stdin is not valid JSON: %s" % exc)


def _read(path: str):
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except OSError:
        return None


def write_ssh_config(root: Root, runtime: Runtime) -> str:
    """The run's SSH config in the private directory (0600): root's block for the nodes, with root's
    own key and the cluster's known_hosts where ``node files write`` put them (nothing copied, nothing
    the runtime sees); its path. Missing files: ``not_retryable`` saying which."""
    home = root_home()
    config_path, key_path = os.path.join(home, ".ssh", "config"), os.path.join(home, ".ssh", KEY_NAME)
    block = block_body(decode(_read(root.real(config_path))), SSH_BEGIN, SSH_END)
    missing = [path for path, found in ((config_path + " (its block for the nodes)", block is not None),
                                        (key_path, os.path.isfile(root.real(key_path))),
                                        (KNOWN_HOSTS, os.path.isfile(root.real(KNOWN_HOSTS)))) if not found]
    if missing:
        raise AgentError(NOT_RETRYABLE, "The cluster's own SSH is not set up on this machine (%s missing): the "
                                        "console writes it when the cluster starts (node files write)"
                         % ", ".join(missing))
    path = os.path.join(runtime.dir, "ssh_config")
    write_private(path, run_ssh_config(block, root.real(key_path), root.real(KNOWN_HOSTS)).encode())
    return path


def _prepare(runtime: Runtime, spec: dict, name: str) -> list:
    """The run's record and (with other nodes) its SSH config in the private directory, the launcher
    in the runtime; mpirun's argv."""
    write_private(os.path.join(runtime.dir, "run.json"), json.dumps(
        {"cluster": spec["cluster"], "pid": os.getpid(), "started_at": round(time.time(), 3)}).encode(), 0o644)
    launcher = runtime.put_launcher(launcher_text(name))
    return mpirun_argv(spec, launcher, runtime.program)


def _check_tools(runtime: Runtime, spec: dict) -> None:
    """mpirun, all_reduce_perf (and python3 for the launcher, with other nodes) in the runtime, and ssh on
    the machine, else ``not_retryable``."""
    programs = [MPIRUN, runtime.program] + ([LAUNCHER_PYTHON] if len(spec["nodes"]) > 1 else [])
    missing = runtime.missing(programs)
    if missing:
        where = "The runtime container fadenstack-%s" % spec["cluster"] if runtime.in_container else "This machine"
        raise AgentError(NOT_RETRYABLE, "%s has no %s: the NCCL test needs Open MPI's mpirun, nccl-tests' "
                                        "all_reduce_perf and python3 in the runtime image"
                         % (where, ", ".join(missing)))
    if len(spec["nodes"]) > 1 and shutil.which("ssh") is None:
        raise AgentError(NOT_RETRYABLE, "This machine has no ssh: the NCCL test's head reaches the other nodes "
                                        "over the cluster's SSH from the machine (not from the runtime)")


def _serve_launches(runtime: Runtime, spec: dict, name: str, config: str, run_holder: dict):
    """The run's launches (``allreducelaunch``): each node of the run once (mpirun runs the head's ranks
    itself when it knows the head's address as its own; when it does not, it launches there too)."""
    remote = remote_agent_argv(spec["cluster"], running_zip(), source_root())

    def allowed(pid: int) -> bool:
        run = run_holder.get("run")
        return run is not None and runtime.caller_check(run.proc)(pid)

    return LaunchServer(name, [node["address"] for node in spec["nodes"]],
                        lambda host, command: ssh_argv(config, host, remote, command), allowed)


@command("allreduce", "run", args=[STORE])
def cmd_run(args, out) -> int:
    """``allreduce run [--store PATH]``: the NCCL test, on the head: nccl-tests' all_reduce_perf across
    every node of the spec on stdin, under mpirun in the cluster's runtime.

    Each line the run prints comes as ``{"event": "progress", "line"}``.  Result: ``{"exit_status",
    "timed_out", "stderr_tail": [its last lines], "seconds"}``.  The timeout, or the console closing the
    session, ends it on every node.  Another run on this machine: ``retryable``, naming it; the runtime
    not started or without mpirun, all_reduce_perf or python3, or the SSH files missing: ``not_retryable``.
    """
    spec = _read_stdin_spec()
    store = store_dir(args.store)
    runtime = Runtime(store, spec["cluster"])
    fd = _lock(runtime)
    server = None
    try:
        _check_tools(runtime, spec)
        name, holder = socket_name(), {}
        if len(spec["nodes"]) > 1:
            config = write_ssh_config(Root.from_env(), runtime)
            server = _serve_launches(runtime, spec, name, config, holder)
        argv = _prepare(runtime, spec, name)
        out.log("running: %s" % " ".join(argv))
        started = time.monotonic()
        run = Run(runtime, argv, node_env(Root.from_env()))
        holder["run"] = run
        ended = run.stream(started + spec["timeout"], reader_gone, lambda line: out.progress(line=line))
        if ended is not None:
            out.log("ending the run (%s)" % ("its timeout of %d s" % spec["timeout"] if ended == "timeout"
                                              else "the console went away"))
            run.end()
        code = run.wait()
        return out.result(exit_status=code, timed_out=ended == "timeout", stderr_tail=list(run.stderr),
                          seconds=round(time.monotonic() - started, 3))
    finally:
        if server is not None:
            server.close()
        runtime.clean()
        for leftover in ("run.json", "ssh_config"):
            remove_quietly(os.path.join(runtime.dir, leftover))
        unlock(fd)


@command("allreduce", "exec", args=[
    arg("--cluster", required=True, metavar="NAME", help="the cluster whose runtime runs it"),
    arg("--command", required=True, metavar="TEXT", help="a command line for sh: Open MPI's orted and its options")])
def cmd_exec(args, out) -> int:
    """``allreduce exec --cluster NAME --command TEXT``: on another node, for the head's ``allreduce run``
    (the head's agent calls it over the cluster's SSH when its launcher asks): runs ``sh -c TEXT`` (Open
    MPI's orted) in this node's runtime, never on the machine, with this node's NCCL_* and GLOO_*
    settings, and ends all it started when the head's session closes first (the head's mpirun is gone).

    Prints nothing of its own once the command runs: its output and exit status are the command's.
    The runtime not started or another cluster's: ``not_retryable`` (also on stderr, for mpirun).
    """
    try:
        runtime = Runtime(store_dir(None), args.cluster)
        env = node_env(Root.from_env())
        argv = runtime.argv(pid_wrapped(["sh", "-c", args.command], runtime.dir_inside + "/orted.pid"), sorted(env))
        try:
            proc = subprocess.Popen(argv, env=engine_environ(env), cwd="/", start_new_session=True)
        except OSError as exc:
            raise AgentError(NOT_RETRYABLE, "Cannot run %s on this machine: %s" % (argv[0], exc.strerror or exc))
    except AgentError as exc:
        os.write(2, ("fadenstack-agent allreduce exec: %s\n" % exc.message).encode())
        raise
    return supervise(runtime, proc, "orted.pid")


def supervise(runtime: Runtime, proc, pidfile: str) -> int:
    """Wait for the node's part of the run; if the head's SSH session goes first (its mpirun is gone:
    the session's other end closed), end the part's whole tree. The part's exit status."""
    while True:
        try:
            code = proc.wait(0.5)
            break
        except subprocess.TimeoutExpired:
            pass
        if reader_gone():
            kill_left(snapshot(runtime.root_pid(proc, pidfile) or proc.pid))
            try:
                code = proc.wait(KILL_GRACE)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the engine's client
                code = proc.wait()
            break
    return 128 - code if code < 0 else code
