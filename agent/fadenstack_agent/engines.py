"""The ``docker`` and ``podman`` runtime drivers: Ray in a container of the
loaded runtime image, run by the machine's container engine.  The command
lines are ``containers``', the reading of the engines' answers
``engineoutput``'s; this module runs them.

- ``image load --driver podman``: a runtime image is a container image
  archive (docker-archive, as ``docker save`` / ``podman save --format
  docker-archive`` write it, labelled with its build: ``imagearchive``),
  streamed to ``<engine> load`` with progress.  The reference the engine
  reports goes to ``loaded.json``.
- ``runtime start``: removes the containers other clusters left on this
  machine, then runs ``fadenstack-<cluster>`` detached with the manifest's
  ``command`` (default: a shell that only waits, see ``KEEP_ALIVE``); Ray is
  started in it afterwards by ``ray start-head`` / ``ray join`` through
  ``<engine> exec`` (``ray_argv``, ``python_argv``).
- Ray inside sees the store at ``containers.STORE_IN_CONTAINER`` (a bind
  mount), so its temp dir there is ``<store>/ray`` on the machine; its
  processes are found in the container's pid namespace (``processes``).

The image's labels may name its executables (``ray``, ``python``: default
``ray`` and ``python3`` on the image's PATH) and the container's ``command``
(``imagearchive``).  The machine config's section of the engine's name may
hold ``global_args`` and ``ulimits`` (``containers.Engine``) and ``"gpus":
"none"`` (hand no GPU over: the lab, whose ``nvidia-smi`` is a stand-in); its
``machine_name`` (default: the host name) labels the containers.
"""

import os
import re
import shutil
import socket
import subprocess
import threading
import time

from .cli import arg
from .containers import (AMD, ENGINES, ENV_NAME_RE, MACHINE_RE, NVIDIA, STORE_IN_CONTAINER, WRITABLE, Engine,
                         container_name, ray_auth_env)
from .engineoutput import is_no_such_container, left_by_others, parse_loaded, parse_ps, parse_state
from .facts import Collector
from .files import runtime_dir
from .protocol import BAD_INPUT, NOT_RETRYABLE, RETRYABLE, AgentError
from .rayproc import namespace_pids, read_proc, read_tail
from .secretsdir import make_cluster_dir, ray_token_path

NO_RUNTIME = "No container runtime on this machine: install Docker or Podman"
DRIVER_NAMES = ("process",) + ENGINES
DRIVER = arg("--driver", metavar="NAME",
             help="the runtime driver when the machine config names none: docker, podman or process")
# The container's first process only keeps it alive (Ray comes later, by
# exec).  A shell, not `sleep infinity`: as PID 1 it reaps the processes Ray
# leaves behind, and it ends at once on SIGTERM (PID 1 has no default action).
KEEP_ALIVE = ["sh", "-c", "trap 'exit 0' TERM INT; while :; do sleep 3600 & wait $!; done"]
# Variables `ray start` and the status script get from the agent (by name only).
RAY_ENV_NAMES = ("RAY_USAGE_STATS_ENABLED", "RAY_gcs_server_request_timeout_seconds", "RAY_prestart_worker_first_driver",
                 "RAY_enable_metrics_collection", "DASHBOARD_METRIC_PORT", "AUTOSCALER_METRIC_PORT")


def ray_auth_settings(cluster: str) -> dict:
    """Ray's token authentication for what runs in the cluster's container (Ray, the status driver, the
    copies and their own Ray) once ``cluster secrets write`` put the token on this machine; before that
    (an agent older than the console's step, a test without one) Ray runs as it did."""
    return ray_auth_env() if ray_token_path(cluster) else {}


def ray_env_names() -> list:
    """The variables Ray reads, by name, as the agent has them (``RAY_*``: the machine's own settings
    for Ray, like the lab's shorter node health checks), so Ray in the container sees what Ray
    started without one would; values stay in the environment, never in ``ps``."""
    present = (name for name in os.environ if name.startswith("RAY_") and ENV_NAME_RE.match(name))
    return sorted(set(RAY_ENV_NAMES) | set(present))
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
ENGINE_TIMEOUT = 60
RUN_TIMEOUT = 300             # `run` may create a large image's container layer
LOAD_TIMEOUT = 3600           # a runtime image is some GB
STOP_TIMEOUT = 10             # SIGTERM -> SIGKILL for the container
START_SETTLE = 1.0            # a container must still run this long after `run` to count as started
LOG_LINES = 20
PROGRESS_EVERY = 1.0


def chosen_driver(config: dict, requested=None):
    """The runtime driver's name: the machine config's ``runtime_driver`` (the
    lab's ``process``), else the one the console asks for (``--driver``, the
    machine's recorded runtime), else None."""
    if requested is not None and requested not in DRIVER_NAMES:
        raise AgentError(BAD_INPUT, "--driver must be one of %s, got %r" % (", ".join(DRIVER_NAMES), requested))
    configured = config.get("runtime_driver")
    if configured not in (None, ""):
        return configured
    return requested or None


def last_lines(text: str, count: int = 5, limit: int = 1500) -> str:
    """The machine's own words: the last non-empty lines of an output."""
    lines = [line.rstrip() for line in (text or "").splitlines() if line.strip()]
    words = " | ".join(lines[-count:])
    return ("..." + words[-limit:]) if len(words) > limit else (words or "no output")


def run_engine(argv: list, timeout: float = ENGINE_TIMEOUT, env=None) -> tuple:
    """``(exit status, stdout, stderr)`` of one engine command (``env``: the engine's environment)."""
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              timeout=timeout, cwd="/", env=env)
    except (FileNotFoundError, PermissionError) as exc:
        raise AgentError(NOT_RETRYABLE, "Cannot run %s on this machine: %s" % (argv[0], exc.strerror or exc))
    except subprocess.TimeoutExpired:
        raise AgentError(RETRYABLE, "%s did not answer within %d s: %s"
                         % (argv[0], timeout, " ".join(argv)[:300]))
    return (proc.returncode, proc.stdout.decode("utf-8", "replace"),
            proc.stderr.decode("utf-8", "replace"))


def machine_name(config: dict) -> str:
    """This machine's name for the containers' label: the machine config's
    ``machine_name``, else its host name.  Machines sharing one engine (a lab
    host, a test) must differ in it: a machine removes only its own leftovers."""
    name = config.get("machine_name")
    if name is not None:
        if not isinstance(name, str) or not MACHINE_RE.match(name):
            raise AgentError(NOT_RETRYABLE, "The machine config's machine_name must be letters, digits, "
                                            "dots, dashes and underscores, got %r" % (name,))
        return name
    name = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname()).lstrip("._-")[:253]
    return name if MACHINE_RE.match(name) else "machine"


def has_cdi_specs() -> bool:
    """NVIDIA's CDI specs (``nvidia-ctk cdi generate``) are on this machine."""
    for directory in CDI_DIRS:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if not name.endswith((".yaml", ".yml", ".json")):
                continue
            try:
                with open(os.path.join(directory, name), "rb") as fh:
                    if b"nvidia.com/gpu" in fh.read(1 << 20):
                        return True
            except OSError:
                continue
    return False


def namespace_processes(pid: int) -> list:
    """The processes in the pid namespace of ``pid`` (the container's first
    process), by this machine's pids: Ray in a container is found, and
    stopped, from outside it (``rayproc``, ``raystop``), as on the machine."""
    return [proc for proc in map(read_proc, namespace_pids(pid)) if proc is not None and proc.argv]



# ------------------------------------------------------------------ images


def has_image(engine: Engine, image: str) -> bool:
    return run_engine(engine.image_exists_argv(image))[0] == 0


def load_image(engine: Engine, store: str, path: str, digest: str, out) -> str:
    """Stream the runtime image (a docker-archive) to ``<engine> load``; the
    image reference it reports.  The engine's words go to
    ``<store>/runtime/image-load.log``; a refusal is ``not_retryable`` in them."""
    log_path = os.path.join(runtime_dir(store), "image-load.log")
    os.makedirs(os.path.dirname(log_path), mode=0o755, exist_ok=True)
    argv = engine.load_stdin_argv()
    out.log("loading the container image of %s into %s" % (digest[:12], engine.name))
    with open(path, "rb") as image, open(log_path, "wb") as log:
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, cwd="/")
        except (FileNotFoundError, PermissionError) as exc:
            raise AgentError(NOT_RETRYABLE, "Cannot run %s on this machine: %s" % (argv[0], exc.strerror or exc))
        # A stalled engine must not hold the agent for ever: killing it breaks our pipe.
        watchdog = threading.Timer(LOAD_TIMEOUT, proc.kill)
        watchdog.start()
        try:
            _feed(image, proc.stdin, os.fstat(image.fileno()).st_size, digest, out)
            code = proc.wait()
        finally:
            watchdog.cancel()
    words = read_tail(log_path)
    if code != 0:
        why = "did not finish within %d s" % LOAD_TIMEOUT if code < 0 else "refused it (exit status %d)" % code
        raise AgentError(NOT_RETRYABLE, "%s %s: the runtime image %s could not be loaded: %s"
                         % (engine.name, why, digest[:12], last_lines(words)))
    return parse_loaded(words)[0]


def _feed(source, sink, total: int, digest: str, out) -> None:
    sent, told = 0, time.monotonic()
    try:
        while True:
            block = source.read(1 << 20)
            if not block:
                break
            sink.write(block)
            sent += len(block)
            if time.monotonic() - told >= PROGRESS_EVERY:
                out.progress(digest=digest, bytes=sent, total=total, stage="load")
                told = time.monotonic()
        sink.close()
    except BrokenPipeError:
        pass        # the engine gave up reading: its exit status and words tell why


# ------------------------------------------------------------------ the driver


class ContainerDriver:
    """Ray in the cluster's container ``fadenstack-<cluster>``, by Docker or Podman."""

    per_cluster = True

    def __init__(self, engine: Engine, cluster: str, ray: str = "ray", python: str = "python3",
                 gpus: str = "auto"):
        self.engine = engine
        self.name = engine.name
        self.cluster = cluster
        self.container = container_name(cluster)
        self.ray, self.python = ray, python
        self.gpus = gpus

    @classmethod
    def from_config(cls, name: str, config: dict, cluster: str, ray=None, python=None) -> "ContainerDriver":
        engine = Engine.from_config(name, config)
        gpus = (config.get(name) or {}).get("gpus", "auto")
        if gpus not in ("auto", "none"):
            raise AgentError(NOT_RETRYABLE, "The machine config's \"%s\".gpus must be \"auto\" or \"none\", "
                                            "got %r" % (name, gpus))
        return cls(engine, cluster, ray or "ray", python or "python3", gpus)

    def check(self) -> None:
        if shutil.which(self.name) is None:
            raise AgentError(NOT_RETRYABLE, "The runtime driver is %s, but %s is not installed on this "
                                            "machine" % (self.name, self.name))

    # What `ray` runs: the image's executables, inside the running container.

    def ray_argv(self, *args) -> list:
        return self.engine.exec_argv(self.cluster, [self.ray] + list(args), ray_env_names(),
                                     settings=ray_auth_settings(self.cluster))

    def python_argv(self, *args) -> list:
        return self.engine.exec_argv(self.cluster, [self.python, "-I"] + list(args), ray_env_names(),
                                     settings=ray_auth_settings(self.cluster))

    def start_args(self) -> list:
        return []

    def ray_temp_dir(self, store: str) -> str:
        return STORE_IN_CONTAINER + "/ray"

    def host_path(self, store: str, path: str) -> str:
        """A path Ray printed in the container -> the same file on this machine."""
        if path == STORE_IN_CONTAINER or path.startswith(STORE_IN_CONTAINER + "/"):
            return store + path[len(STORE_IN_CONTAINER):]
        return path

    def processes(self) -> list:
        state = self.state()
        return namespace_processes(state["pid"]) if state and state["pid"] else []

    def describe(self) -> dict:
        return {"name": self.name, "engine": self.name, "cluster": self.cluster, "container": self.container,
                "ray": self.ray, "python": self.python}

    # The container.

    def state(self):
        """The container's state (``containers.parse_state``), or None when absent."""
        code, stdout, stderr = run_engine(self.engine.inspect_argv(self.cluster))
        if code != 0:
            if is_no_such_container(stderr + stdout):
                return None
            raise AgentError(RETRYABLE, "%s cannot tell the state of %s: %s"
                             % (self.name, self.container, last_lines(stderr + stdout)))
        return parse_state(stdout)

    def is_up(self) -> bool:
        state = self.state()
        return bool(state and state["running"])

    def logs(self, lines: int = LOG_LINES) -> str:
        code, stdout, stderr = run_engine(self.engine.logs_argv(self.cluster, lines))
        return stdout + stderr if code == 0 else ""

    def status(self) -> dict:
        """For ``runtime status``: ``{"name", "state": running|exited|...|absent,
        "exit_code", "log": last lines when not running}``."""
        state = self.state()
        if state is None:
            return {"name": self.container, "state": "absent", "exit_code": None, "log": None}
        return {"name": self.container, "state": state["status"], "exit_code": state["exit_code"],
                "log": None if state["running"] else last_lines(self.logs(), LOG_LINES, 4000)}

    def remove_others(self, machine: str, out) -> list:
        """Remove what other clusters left on this machine; their names."""
        code, stdout, stderr = run_engine(self.engine.ps_argv(machine))
        if code != 0:
            raise AgentError(RETRYABLE, "%s cannot list this machine's containers: %s"
                             % (self.name, last_lines(stderr + stdout)))
        removed = left_by_others(parse_ps(stdout), self.cluster)
        for name in removed:
            out.log("removing %s, left by another cluster" % name)
            self._remove(name)
        return removed

    def _remove(self, name: str) -> None:
        code, stdout, stderr = run_engine(self.engine.rm_argv(name=name), STOP_TIMEOUT + ENGINE_TIMEOUT)
        if code != 0 and not is_no_such_container(stderr + stdout):
            raise AgentError(RETRYABLE, "%s cannot remove the container %s: %s"
                             % (self.name, name, last_lines(stderr + stdout)))

    def start(self, image: str, store: str, manifest: dict, config: dict, out) -> dict:
        """Run the cluster's container of ``image`` (whatever ran under its name
        is removed first); it must still run ``START_SETTLE`` s later.  Returns
        ``{"container", "removed": [names left by other clusters]}``."""
        machine = machine_name(config)
        removed = self.remove_others(machine, out)
        self._remove(self.container)
        gpu, cdi = self.gpu_vendor(config), False
        if gpu == NVIDIA and self.name == "docker":
            cdi = has_cdi_specs()
        for sub in WRITABLE:
            os.makedirs(os.path.join(store, sub), mode=0o755, exist_ok=True)
        argv = self.engine.run_argv(self.cluster, machine, image, container_command(manifest), store,
                                    gpu=gpu, cdi=cdi, secrets_dir=make_cluster_dir(self.cluster))
        out.log("running: %s" % " ".join(argv))
        code, stdout, stderr = run_engine(argv, RUN_TIMEOUT)
        if code != 0:
            raise AgentError(NOT_RETRYABLE, "%s could not start the runtime container %s: %s"
                             % (self.name, self.container, last_lines(stderr + stdout + "\n" + self.logs())))
        # A command that fails at once (a missing library, a bad device) ends
        # within moments; the engine's `run -d` returns before that shows.
        deadline = time.monotonic() + START_SETTLE
        state = self.state()
        while state is not None and state["running"] and time.monotonic() < deadline:
            time.sleep(0.1)
            state = self.state()
        if state is None or not state["running"]:
            exit_code = state["exit_code"] if state else None
            raise AgentError(NOT_RETRYABLE, "The runtime container %s stopped right after it started "
                                            "(exit status %s); its last lines: %s"
                             % (self.container, exit_code, last_lines(self.logs(), 10)))
        return {"container": self.container, "removed": removed}

    def stop(self, out) -> bool:
        """Stop and remove the cluster's container; False when there was none."""
        if self.state() is None:
            return False
        out.log("stopping and removing %s" % self.container)
        code, stdout, stderr = run_engine(self.engine.stop_argv(self.cluster, STOP_TIMEOUT),
                                          STOP_TIMEOUT + ENGINE_TIMEOUT)
        if code != 0 and not is_no_such_container(stderr + stdout):
            out.log("%s stop %s: %s" % (self.name, self.container, last_lines(stderr + stdout)))
        self._remove(self.container)
        return True

    def gpu_vendor(self, config: dict):
        """The GPUs' vendor as ``facts`` finds them (None: none, or ``gpus: none``)."""
        if self.gpus == "none":
            return None
        vendors = [a.get("vendor") for a in Collector(config=config).accelerators()]
        for vendor in (NVIDIA, AMD):
            if vendor in vendors:
                return vendor
        return None


def container_command(manifest: dict) -> list:
    command = manifest.get("command", KEEP_ALIVE)
    if not isinstance(command, list) or not command or not all(isinstance(part, str) for part in command):
        raise AgentError(NOT_RETRYABLE, "The runtime image's label org.fadenstack.runtime.command is not a "
                                        "list of arguments: %r" % (command,))
    return list(command)


def image_executable(manifest: dict, key: str):
    """The manifest's ``ray`` / ``python`` executable in the image, or None (the default)."""
    value = manifest.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or value.startswith("-") or re.search(r"\s", value):
        raise AgentError(NOT_RETRYABLE, "The runtime image's manifest.json names %s %r, which is not an "
                                        "executable's path" % (key, value))
    return value
