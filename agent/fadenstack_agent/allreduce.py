"""``allreduce run|exec``: the NCCL test, nccl-tests' ``all_reduce_perf`` across the cluster's nodes.

nccl-tests spans machines only under MPI (without it, it is one process on one node: NVIDIA's answer
in nccl-tests issue #121), so the head runs Open MPI's ``mpirun`` inside its runtime container, one
process per GPU with ``-g 1``, which serves nodes of different GPU counts (``allreducespec.mpirun_argv``,
a pure function of the spec, as everything built from it is)::

    mpirun --allow-run-as-root --leave-session-attached --hostfile <store>/allreduce/hostfile -np <all GPUs>
           --map-by slot --bind-to none --mca plm_rsh_agent <store>/allreduce/launch
           --mca plm_rsh_no_tree_spawn 1 -x FADEN_ALLREDUCE_NODES=ADDR,... -x FADEN_ALLREDUCE_SLOTS=G,...
           all_reduce_perf -b MIN -e MAX -f 2 -g 1 -n ITERS -w WARMUP -c 1

The hostfile names the nodes' addresses, a slot per GPU, head first (Open MPI runs the head's process
itself). For every other node mpirun calls the launcher (``launcher_text``, written to the store,
which the container sees at ``/var/lib/fadenstack``) with the address and the command line of its
daemon, ``orted``; the launcher reaches the node over the cluster's own SSH and has that node's agent
run it: ``allreduce exec``, which runs the command inside the node's own runtime container (the
engine and the container its ``runtime start`` recorded) and stays, watching its SSH session.
``orted`` then starts the node's ``all_reduce_perf``; its output travels back to mpirun, which prints
rank 0's table. (orted also wants the launcher's path to exist on its node: ``exec`` puts a placeholder.)

The cluster's SSH is what ``node files write`` put on the machine (root's ``~/.ssh/config`` block for
the nodes, the key ``~root/.ssh/fadenstack_cluster``, ``/etc/fadenstack/known_hosts``): for the run
they are copied into ``<store>/allreduce/ssh/`` (0600; the config's key and known_hosts paths made
the copies'), which the container sees with the store, and taken away when the run ends: no mount of
root's files, and a container started before the files were written runs the test as well.

Every line mpirun prints on stdout is a progress event ``{"line": ...}`` as it comes; stderr's last
lines come in the result. The timeout, or the console going away (its SSH channel closed: stdout's
reader is gone, which is how the console aborts), ends the run: mpirun gets SIGTERM, on which it ends
every rank and every node's orted itself. Open MPI does not promise that much for a mpirun killed
outright (tried: a SIGKILLed mpirun leaves its own ranks and, daemonized, the nodes' orteds running),
so the run's process tree is taken before the SIGTERM and whatever of it is left after ``KILL_GRACE``
s gets SIGKILL (``proctree``): mpirun, the head's ranks and the launchers' SSH clients, whose
sessions closing make each node's ``allreduce exec`` end its own tree. One run at a time per machine
(a lock file). With the ``process`` driver (the lab's) the same commands run on the machine itself.
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
from .allreducespec import (MPIRUN, PLACEHOLDER_LAUNCHER, PROGRAM, check_spec, hostfile_text, kill_argv, launcher_text, mpirun_argv,
                            node_env, pid_wrapped, remote_agent_argv, run_ssh_config)
from .containers import STORE_IN_CONTAINER, engine_environ
from .files import (agent_home, load_machine_config, read_json, remove_quietly, running_zip, source_root, store_dir,
                    try_lock, unlock, write_json)
from .nodeedit import Root, block_body, decode
from .nodefiles import KEY_NAME, KNOWN_HOSTS, SSH_BEGIN, SSH_END, root_home
from .proctree import host_pid, kill_left, snapshot
from .protocol import BAD_INPUT, NOT_RETRYABLE, RETRYABLE, AgentError
from .runtime import read_state, recorded_driver

RUN_DIR = "allreduce"              # under the store: the hostfile, the launcher, the pid file, the run's record
KILL_GRACE = 10.0                  # SIGTERM to mpirun -> SIGKILL
STDERR_LINES = 60
LOCK_BUSY = "An NCCL test (allreduce run) is already running on this machine"

group("allreduce", help="the NCCL test: nccl-tests' all_reduce_perf across the cluster's nodes under mpirun")


# ------------------------------------------------------------------ the runtime


class Runtime:
    """Where the run's commands go: the cluster's container (by its engine), or the machine itself."""

    def __init__(self, store: str, cluster: str):
        state = read_state(store)
        if state.get("state") != "started":
            raise AgentError(NOT_RETRYABLE, "The runtime is not started on this machine: the NCCL test runs in the "
                                            "cluster's runtime (start the cluster first)")
        if state.get("cluster") not in (None, cluster) and state.get("driver") != "process":
            raise AgentError(NOT_RETRYABLE, "This machine's runtime is cluster %s's, not %s's"
                             % (state.get("cluster"), cluster))
        config = load_machine_config()
        self.driver = recorded_driver(store, config)
        self.store, self.cluster = store, cluster
        # The process driver's all_reduce_perf may be named by path (the lab's stub), as its vllm is.
        named = (config.get("process") or {}).get(PROGRAM) if not self.driver.per_cluster else None
        self.program = named if isinstance(named, str) and os.path.isabs(named) else PROGRAM
        self.in_container = self.driver.per_cluster
        inside = STORE_IN_CONTAINER if self.in_container else store
        self.dir, self.dir_inside = os.path.join(store, RUN_DIR), inside + "/" + RUN_DIR

    def argv(self, command: list, env_names=()) -> list:
        if self.in_container:
            return self.driver.engine.exec_argv(self.cluster, command, env_names)
        return list(command)

    def root_pid(self, proc, pidfile: str):
        """The machine's pid of the run's first process: ``proc`` itself on the machine; in a container,
        the process whose pid there the pid file holds."""
        if not self.in_container:
            return proc.pid
        try:
            with open(pidfile) as handle:
                inner = int(handle.read().strip())
            anchor = (self.driver.state() or {}).get("pid")
        except (OSError, ValueError, AgentError):
            return None
        return host_pid(inner, anchor) if anchor else None

    def missing(self, programs: list) -> list:
        """The programs the run needs that are not on the runtime's PATH (or not there, given by path)."""
        if not self.in_container:
            return [p for p in programs if shutil.which(p) is None]
        script = 'for p in "$@"; do command -v "$p" >/dev/null || echo "$p"; done'
        try:
            done = subprocess.run(self.argv(["sh", "-c", script, "sh"] + programs), stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AgentError(RETRYABLE, "%s did not answer about the runtime container: %s" % (self.driver.name, exc))
        if done.returncode != 0:
            raise AgentError(NOT_RETRYABLE, "The runtime container fadenstack-%s cannot run commands: %s"
                             % (self.cluster, (done.stderr or done.stdout).decode(errors="replace").strip()[-300:]))
        return done.stdout.decode(errors="replace").split()


# ------------------------------------------------------------------ the run


class Run:
    """mpirun, started, read line by line, and ended when told (timeout, console gone)."""

    def __init__(self, runtime: Runtime, argv: list, env: dict):
        self.runtime = runtime
        self.pidfile = runtime.dir + "/mpirun.pid"
        remove_quietly(self.pidfile)
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
        SSH sessions with it, which ends each node's part). True when something had to be killed."""
        taken = snapshot(self.runtime.root_pid(self.proc, self.pidfile) or self.proc.pid)
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


def _lock(store: str, cluster: str):
    """The machine's one run: the lock's fd, or ``retryable`` naming the run that holds it."""
    path = os.path.join(agent_home(), "allreduce.lock")
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    fd = try_lock(path)
    if fd is None:
        held = read_json(os.path.join(store, RUN_DIR, "run.json")) or {}
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


def copy_ssh_files(root: Root, runtime: Runtime) -> str:
    """The cluster's SSH files, copied for the run (``<store>/allreduce/ssh/``, 0700, files 0600);
    the config's path as the runtime sees it. Missing files: ``not_retryable`` saying which."""
    home = root_home()
    config_path, key_path = os.path.join(home, ".ssh", "config"), os.path.join(home, ".ssh", KEY_NAME)
    block = block_body(decode(_read(root.real(config_path))), SSH_BEGIN, SSH_END)
    key, known = _read(root.real(key_path)), _read(root.real(KNOWN_HOSTS))
    missing = [path for path, found in ((config_path + " (its block for the nodes)", block), (key_path, key),
                                        (KNOWN_HOSTS, known)) if found is None]
    if missing:
        raise AgentError(NOT_RETRYABLE, "The cluster's own SSH is not set up on this machine (%s missing): the "
                                        "console writes it when the cluster starts (node files write)"
                         % ", ".join(missing))
    local, inside = runtime.dir + "/ssh", runtime.dir_inside + "/ssh"
    os.makedirs(local, mode=0o700, exist_ok=True)
    os.chmod(local, 0o700)
    texts = {"key": key, "known_hosts": known,
             "config": run_ssh_config(block, inside + "/key", inside + "/known_hosts").encode()}
    for name, data in texts.items():
        fd = os.open(os.path.join(local, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
    return inside + "/config"


def write_executable(path: str, text: str, keep: bool = False) -> None:
    if keep and os.path.exists(path):
        return  # a head's own launcher (this node leads runs too)
    with open(path, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o755)


def remove_ssh_files(runtime: Runtime) -> None:
    for name in ("key", "known_hosts", "config"):
        remove_quietly(os.path.join(runtime.dir, "ssh", name))


def _prepare(runtime: Runtime, spec: dict) -> list:
    """The hostfile, the launcher and (with other nodes) the SSH files in the store; mpirun's argv."""
    os.makedirs(runtime.dir, mode=0o755, exist_ok=True)
    hostfile, launcher = runtime.dir + "/hostfile", runtime.dir + "/launch"
    write_json(runtime.dir + "/run.json", {"cluster": spec["cluster"], "pid": os.getpid(),
                                            "started_at": round(time.time(), 3)})
    ssh_config = copy_ssh_files(Root.from_env(), runtime) if len(spec["nodes"]) > 1 else "/dev/null"
    with open(hostfile, "w") as handle:
        handle.write(hostfile_text(spec["nodes"]))
    write_executable(launcher, launcher_text(remote_agent_argv(spec["cluster"], running_zip(), source_root()), ssh_config))
    return mpirun_argv(spec, runtime.dir_inside + "/hostfile", runtime.dir_inside + "/launch", runtime.program)


def _check_tools(runtime: Runtime, spec: dict) -> None:
    """mpirun, all_reduce_perf (and ssh, with other nodes) in the runtime, else ``not_retryable``."""
    programs = [MPIRUN, runtime.program] + (["ssh"] if len(spec["nodes"]) > 1 else [])
    missing = runtime.missing(programs)
    if missing:
        where = "The runtime container fadenstack-%s" % spec["cluster"] if runtime.in_container else "This machine"
        raise AgentError(NOT_RETRYABLE, "%s has no %s: the NCCL test needs Open MPI's mpirun, nccl-tests' "
                                        "all_reduce_perf and an SSH client in the runtime image"
                         % (where, ", ".join(missing)))


@command("allreduce", "run", args=[STORE])
def cmd_run(args, out) -> int:
    """``allreduce run [--store PATH]``: the NCCL test, on the head: nccl-tests' all_reduce_perf across
    every node of the spec on stdin, under mpirun in the cluster's runtime.

    Each line the run prints comes as ``{"event": "progress", "line"}``.  Result: ``{"exit_status",
    "timed_out", "stderr_tail": [its last lines], "seconds"}``.  The timeout, or the console closing the
    session, ends it on every node.  Another run on this machine: ``retryable``, naming it; the runtime
    not started or without mpirun, all_reduce_perf or the SSH files: ``not_retryable``.
    """
    spec = _read_stdin_spec()
    store = store_dir(args.store)
    runtime = Runtime(store, spec["cluster"])
    fd = _lock(store, spec["cluster"])
    try:
        _check_tools(runtime, spec)
        argv = _prepare(runtime, spec)
        out.log("running: %s" % " ".join(argv))
        started = time.monotonic()
        run = Run(runtime, argv, node_env(Root.from_env()))
        ended = run.stream(started + spec["timeout"], reader_gone, lambda line: out.progress(line=line))
        if ended is not None:
            out.log("ending the run (%s)" % ("its timeout of %d s" % spec["timeout"] if ended == "timeout"
                                              else "the console went away"))
            run.end()
        code = run.wait()
        return out.result(exit_status=code, timed_out=ended == "timeout", stderr_tail=list(run.stderr),
                          seconds=round(time.monotonic() - started, 3))
    finally:
        remove_ssh_files(runtime)
        remove_quietly(os.path.join(runtime.dir, "run.json"))
        unlock(fd)


@command("allreduce", "exec", args=[
    arg("--cluster", required=True, metavar="NAME", help="the cluster whose runtime runs it"),
    arg("--command", required=True, metavar="TEXT", help="a command line for sh: Open MPI's orted and its options")])
def cmd_exec(args, out) -> int:
    """``allreduce exec --cluster NAME --command TEXT``: on another node, for the head's ``allreduce run``
    (its launcher calls it over the cluster's SSH): runs ``sh -c TEXT`` (Open MPI's orted) in this
    node's runtime, with this node's NCCL_* and GLOO_* settings, and ends all it started when the
    head's session closes first (the head's mpirun is gone).

    Prints nothing of its own once the command runs: its output and exit status are the command's.
    The runtime not started or another cluster's: ``not_retryable`` (also on stderr, for mpirun).
    """
    try:
        runtime = Runtime(store_dir(None), args.cluster)
        env = node_env(Root.from_env())
        argv = runtime.argv(pid_wrapped(["sh", "-c", args.command], runtime.dir_inside + "/orted.pid"), sorted(env))
        os.makedirs(runtime.dir, mode=0o755, exist_ok=True)
        remove_quietly(runtime.dir + "/orted.pid")
        write_executable(runtime.dir + "/launch", PLACEHOLDER_LAUNCHER, keep=True)
        try:
            proc = subprocess.Popen(argv, env=engine_environ(env), cwd="/", start_new_session=True)
        except OSError as exc:
            raise AgentError(NOT_RETRYABLE, "Cannot run %s on this machine: %s" % (argv[0], exc.strerror or exc))
    except AgentError as exc:
        os.write(2, ("fadenstack-agent allreduce exec: %s\n" % exc.message).encode())
        raise
    return supervise(runtime, proc, runtime.dir + "/orted.pid")


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
