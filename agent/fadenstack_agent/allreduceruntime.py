"""Where an NCCL test's commands run (``allreduce run|exec``): the cluster's runtime container, through
its engine's ``exec``, or the machine itself with the ``process`` driver. The run's files inside the
runtime are written and read through ``exec`` so that a link planted there resolves in the container's
own view, never the machine's (docs/security.md, "The NCCL test keeps root out of the container").
"""

import os
import shutil
import subprocess

from .allreducelaunch import descendant_of, in_namespace_of, private_dir, read_private, remove_quietly, write_private
from .allreducespec import PROGRAM
from .files import load_machine_config
from .proctree import host_pid
from .protocol import NOT_RETRYABLE, RETRYABLE, AgentError
from .runtime import read_state, recorded_driver

INSIDE_DIR = "/tmp/fadenstack-allreduce"  # in the runtime container: the launcher, the pid files


class Runtime:
    """Where the run's commands go: the cluster's container (by its engine), or the machine itself.
    ``dir_inside``: the run's files as the runtime sees them (in the container, written and read
    through ``exec``; with ``process``, the private directory itself)."""

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
        self.dir = private_dir(store)
        self.dir_inside = INSIDE_DIR if self.in_container else self.dir

    def argv(self, command: list, env_names=()) -> list:
        if self.in_container:
            return self.driver.engine.exec_argv(self.cluster, command, env_names)
        return list(command)

    def _inside(self, script: str, *words, timeout=60):
        """``sh -c script`` in the runtime, with ``words``: its exit status and output."""
        try:
            done = subprocess.run(self.argv(["sh", "-c", script, "sh"] + list(words)), stdin=subprocess.DEVNULL,
                                  capture_output=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise AgentError(RETRYABLE, "%s did not answer about the runtime container: %s" % (self.driver.name, exc))
        return done.returncode, done.stdout, done.stderr

    def put_launcher(self, text: str) -> str:
        """The launcher, where the runtime runs it; its path there."""
        path = self.dir_inside + "/launch"
        if not self.in_container:
            write_private(path, text.encode(), 0o600)
            return path
        code, _, err = self._inside('mkdir -p -m 700 "$1" && rm -f "$1/launch" && printf %s "$2" > "$1/launch"',
                                    self.dir_inside, text)
        if code != 0:
            raise AgentError(NOT_RETRYABLE, "Cannot write the NCCL test's launcher in the runtime container "
                                            "fadenstack-%s: %s" % (self.cluster, err.decode(errors="replace").strip()[-300:]))
        return path

    def clean(self) -> None:
        """The run's files in the runtime (the container's own ``/tmp``: nothing of the machine's)."""
        if self.in_container:
            try:
                self._inside('rm -rf "$1"', self.dir_inside, timeout=30)
            except AgentError:
                pass
        else:
            for name in ("launch", "mpirun.pid", "orted.pid"):
                remove_quietly(os.path.join(self.dir, name))

    def inner_pid(self, name: str):
        """The pid a pid file of the run holds, as the runtime wrote it (read inside the container: the
        runtime's word, used only to find processes in its own pid namespace)."""
        if self.in_container:
            try:
                code, text, _ = self._inside('cat "$1"', self.dir_inside + "/" + name, timeout=30)
            except AgentError:
                return None
        else:
            text = read_private(os.path.join(self.dir, name)) or b""
        try:
            return int(text.decode().strip())
        except (UnicodeDecodeError, ValueError):
            return None

    def root_pid(self, proc, name: str):
        """The machine's pid of the run's first process: ``proc`` itself on the machine; in a container,
        the process of the container's pid namespace whose pid there the pid file holds."""
        if not self.in_container:
            return proc.pid
        inner = self.inner_pid(name)
        try:
            anchor = (self.driver.state() or {}).get("pid")
        except AgentError:
            return None
        return host_pid(inner, anchor) if inner and anchor else None

    def caller_check(self, proc):
        """Who may ask for launches: processes of the runtime container, or mpirun's descendants."""
        if not self.in_container:
            return descendant_of(proc.pid)
        try:
            anchor = (self.driver.state() or {}).get("pid")
        except AgentError:
            anchor = None
        return in_namespace_of(anchor) if anchor else (lambda pid: False)

    def missing(self, programs: list) -> list:
        """The programs the run needs that are not on the runtime's PATH (or not there, given by path)."""
        if not self.in_container:
            return [p for p in programs if shutil.which(p) is None]
        code, out, err = self._inside('for p in "$@"; do command -v "$p" >/dev/null || echo "$p"; done', *programs)
        if code != 0:
            raise AgentError(NOT_RETRYABLE, "The runtime container fadenstack-%s cannot run commands: %s"
                             % (self.cluster, (err or out).decode(errors="replace").strip()[-300:]))
        return out.decode(errors="replace").split()


