"""``runtime start|stop|status``: the container that runs Ray and the engine.

The machine config (``/etc/fadenstack/agent.json``, see ``files``) names the
runtime driver:

- ``process`` (the lab's): the "container" is a process tree started from a
  configured Python environment instead of ``docker run``::

      {"runtime_driver": "process",
       "process": {"ray": "/path/to/bin/ray", "python": "/path/to/bin/python",
                   "num_cpus": 1}}

  (``num_cpus`` is optional, default 1: the lab puts several machines on a
  host of two cores, and Ray prestarts one idle worker per CPU it is told of.)
  ``runtime start`` checks that the runtime image named by ``--digest`` is the
  loaded one (``<store>/runtime/loaded.json``, written by ``image load``) and
  records the runtime as started in ``<store>/runtime/state.json``; Ray itself
  is started by ``ray start-head`` / ``ray join`` (module ``ray``), which run
  the configured ``ray`` and ``python`` executables as subprocesses.
- ``docker`` / ``podman``: future work (``docker run`` of the loaded image,
  Ray started with ``docker exec``); until then they are refused.

No driver configured: error ``not_retryable`` "No container runtime on this
machine: install Docker or Podman".

Files under ``<store>/runtime``: ``loaded.json`` (``image load``),
``state.json`` (``{"state": "started"|"stopped", "driver", "digest",
"manifest", "started_at", "stopped_at"}``), ``ray.json`` and ``ray.lock``
(module ``ray``), ``ray-start.log`` (the output of the last ``ray start``).
"""

import os
import time

from . import rayargs, rayproc
from .blobstore import check_digest
from .cli import STORE, arg, command, group
from .files import load_machine_config, read_json, runtime_dir, store_dir, write_json
from .image import read_loaded
from .protocol import NOT_RETRYABLE, AgentError

NO_RUNTIME = "No container runtime on this machine: install Docker or Podman"
FUTURE_DRIVERS = ("docker", "podman")


group("runtime", help="the container that runs Ray")


# ------------------------------------------------------------------ files


def state_path(store: str) -> str:
    return os.path.join(runtime_dir(store), "state.json")


def read_state(store: str) -> dict:
    return read_json(state_path(store)) or {}


# ------------------------------------------------------------------ drivers


class ProcessDriver:
    """Ray from a configured Python environment, as plain processes."""

    name = "process"

    def __init__(self, ray: str, python: str, num_cpus: int = 1):
        self.ray = ray
        self.python = python
        self.num_cpus = num_cpus

    @classmethod
    def from_config(cls, config: dict) -> "ProcessDriver":
        section = config.get("process")
        where = "the machine config's \"process\""
        if not isinstance(section, dict):
            raise AgentError(NOT_RETRYABLE, "The runtime driver is \"process\", but %s section is missing: "
                                            "it must name the \"ray\" and \"python\" executables" % where)
        paths = {}
        for key in ("ray", "python"):
            value = section.get(key)
            if not isinstance(value, str) or not os.path.isabs(value):
                raise AgentError(NOT_RETRYABLE, "%s.%s must be the absolute path of the %s executable, "
                                                "got %r" % (where, key, key, value))
            paths[key] = value
        num_cpus = section.get("num_cpus", 1)
        if isinstance(num_cpus, bool) or not isinstance(num_cpus, int) or num_cpus < 1:
            raise AgentError(NOT_RETRYABLE, "%s.num_cpus must be a whole number >= 1, got %r"
                             % (where, num_cpus))
        return cls(paths["ray"], paths["python"], num_cpus)

    def check(self) -> None:
        """The executables exist and may be run (else ``not_retryable``)."""
        for key, path in (("ray", self.ray), ("python", self.python)):
            if not os.path.isfile(path):
                raise AgentError(NOT_RETRYABLE, "The process runtime's %s executable %s does not exist "
                                                "on this machine" % (key, path))
            if not os.access(path, os.X_OK):
                raise AgentError(NOT_RETRYABLE, "The process runtime's %s executable %s is not "
                                                "executable" % (key, path))

    def ray_argv(self, *args) -> list:
        return [self.ray] + list(args)

    def python_argv(self, *args) -> list:
        # -I: no user site, no PYTHON* variables, no current directory on sys.path.
        return [self.python, "-I"] + list(args)

    def start_args(self) -> list:
        """What the process driver adds to every ``ray start``."""
        return ["--num-cpus=%d" % self.num_cpus]

    def describe(self) -> dict:
        return {"name": self.name, "ray": self.ray, "python": self.python, "num_cpus": self.num_cpus}


def load_driver(config=None):
    """The machine's runtime driver, or ``AgentError(not_retryable)``."""
    if config is None:
        config = load_machine_config()
    name = config.get("runtime_driver")
    if name in (None, ""):
        raise AgentError(NOT_RETRYABLE, NO_RUNTIME)
    if name == ProcessDriver.name:
        return ProcessDriver.from_config(config)
    if name in FUTURE_DRIVERS:
        raise AgentError(NOT_RETRYABLE, "The %s runtime driver is not supported by this agent version yet "
                                        "(only the lab's \"process\" driver is)" % name)
    raise AgentError(NOT_RETRYABLE, "Unknown runtime driver %r in the machine config (known: process)"
                     % (name,))


def require_started(store: str, config=None):
    """For ``ray start-head`` / ``ray join``: the driver, with the runtime started."""
    driver = load_driver(config)
    state = read_state(store)
    if state.get("state") != "started":
        raise AgentError(NOT_RETRYABLE, "The runtime is not started on this machine: run `runtime start "
                                        "--digest D` first (after `image load`)")
    driver.check()
    return driver


# ------------------------------------------------------------------ commands


@command("runtime", "start", args=[
    STORE, arg("--digest", required=True, metavar="SHA256", help="the loaded runtime image's sha256")])
def cmd_start(args, out) -> int:
    """``runtime start --digest D [--store PATH]``: start the runtime of the
    loaded image D.  With the process driver that records it as started (Ray
    starts with ``ray start-head`` / ``ray join``).

    Result: ``{"driver", "digest", "manifest", "already_running": bool,
    "replaced": previous digest | null}``.  Errors: no driver, or the driver's
    executables missing, or D not the loaded image -> ``not_retryable``.
    """
    digest = check_digest(args.digest)
    store = store_dir(args.store)
    driver = load_driver()
    driver.check()
    loaded = read_loaded(store)
    if not loaded or not loaded.get("digest"):
        raise AgentError(NOT_RETRYABLE, "No runtime image is loaded on this machine: run `image load "
                                        "--digest %s` first" % digest)
    if loaded.get("digest") != digest:
        raise AgentError(NOT_RETRYABLE, "The loaded runtime image is %s, not %s: run `image load --digest "
                                        "%s` first" % (str(loaded.get("digest"))[:12], digest[:12], digest))
    manifest = loaded.get("manifest") if isinstance(loaded.get("manifest"), dict) else {}
    state = read_state(store)
    replaced = None
    if state.get("state") == "started":
        if state.get("digest") == digest and state.get("driver") == driver.name:
            return out.result(driver=driver.name, digest=digest, manifest=manifest,
                              already_running=True, replaced=None)
        node = rayproc.local_node(rayargs.temp_dir(store))
        if node is not None:
            raise AgentError(NOT_RETRYABLE, "The runtime of image %s is running Ray on this machine: "
                                            "`runtime stop` it before starting %s"
                             % (str(state.get("digest"))[:12], digest[:12]))
        replaced = state.get("digest")
    write_json(state_path(store), {"state": "started", "driver": driver.name, "digest": digest,
                                   "manifest": manifest, "started_at": round(time.time(), 3),
                                   "stopped_at": None})
    out.log("runtime %s of image %s started (%s driver)" % (manifest.get("version", "?"), digest[:12],
                                                          driver.name))
    return out.result(driver=driver.name, digest=digest, manifest=manifest, already_running=False,
                      replaced=replaced)


@command("runtime", "stop", args=[STORE])
def cmd_stop(args, out) -> int:
    """``runtime stop [--store PATH]``: stop Ray (as ``ray stop``) and the runtime.

    Result: ``{"stopped": true, "was_started": bool, "digest", "ray": {the
    result of ray stop}}``.  Running it again is a no-op.
    """
    store = store_dir(args.store)
    ray_result = rayproc.stop_locked(store, out)
    state = read_state(store)
    was_started = state.get("state") == "started"
    if was_started:
        state.update(state="stopped", stopped_at=round(time.time(), 3))
        write_json(state_path(store), state)
    return out.result(stopped=True, was_started=was_started, digest=state.get("digest"), ray=ray_result)


@command("runtime", "status", args=[STORE])
def cmd_status(args, out) -> int:
    """``runtime status [--store PATH]``: the runtime and the Ray node it runs.

    Result: ``{"driver": {"name", ...} | null, "driver_error": text | null,
    "state": "started"|"stopped"|"none", "digest", "manifest", "started_at",
    "loaded_digest", "ray": {"running", "role", "address", "gcs_address",
    "node_id", "pids"}}`` (from the local processes; ``ray status`` asks Ray).
    """
    store = store_dir(args.store)
    try:
        driver, problem = load_driver().describe(), None
    except AgentError as exc:
        driver, problem = None, exc.message
    state = read_state(store)
    loaded = read_loaded(store)
    return out.result(driver=driver, driver_error=problem, state=state.get("state") or "none",
                      digest=state.get("digest"), manifest=state.get("manifest"),
                      started_at=state.get("started_at"), loaded_digest=loaded.get("digest"),
                      ray=rayproc.local_summary(store))
