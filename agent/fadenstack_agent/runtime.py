"""``runtime start|stop|status``: the container that runs Ray and the engine.

The runtime driver: the machine config's ``runtime_driver``
(``/etc/fadenstack/agent.json``, see ``files``) when it names one, else the
one the console passes (``--driver``: the runtime the machine's facts
reported), else error ``not_retryable`` "No container runtime on this
machine: install Docker or Podman".

- ``docker`` / ``podman`` (module ``engines``): ``runtime start`` runs the
  loaded image (``image load --driver ...``) as the container
  ``fadenstack-<cluster>`` and records it; Ray is started in it by ``ray
  start-head`` / ``ray join`` through ``<engine> exec``.
- ``process`` (the lab's fast path): the "container" is a process tree started
  from a configured Python environment instead::

      {"runtime_driver": "process",
       "process": {"ray": "/path/to/bin/ray", "python": "/path/to/bin/python",
                   "num_cpus": 1}}

  (``num_cpus`` is optional, default 1: the lab puts several machines on a
  host of two cores, and Ray prestarts one idle worker per CPU it is told of.)
  ``runtime start`` checks that the runtime image named by ``--digest`` is the
  loaded one and records the runtime as started; ``ray start-head`` / ``ray
  join`` run the configured ``ray`` and ``python`` executables.

The driver that started the runtime is recorded, and the ``ray`` and
``runtime`` commands after it use that one (``recorded_driver``).

Files under ``<store>/runtime``: ``loaded.json`` (``image load``),
``state.json`` (``{"state": "started"|"stopped", "driver", "cluster",
"container", "image", "ray", "python", "digest", "manifest", "started_at",
"stopped_at"}``), ``ray.json`` and ``ray.lock`` (module ``ray``),
``ray-start.log`` (the output of the last ``ray start``), ``image-load.log``
(the engine's output of the last ``image load``).
"""

import os
import time

from . import copyproc, rayproc, raystop
from .blobstore import check_digest
from .cli import STORE, arg, command, group
from .containers import CLUSTER_RE, ENGINES
from .engines import (DRIVER, DRIVER_NAMES, NO_RUNTIME, ContainerDriver, chosen_driver, has_image,
                      image_executable)
from .files import load_machine_config, read_json, runtime_dir, store_dir, write_json
from .image import read_loaded
from .protocol import BAD_INPUT, NOT_RETRYABLE, AgentError
from .rayargs import temp_dir
from .tlsfiles import export_ray_tls

DEFAULT_CLUSTER = "default"
CLUSTER = arg("--cluster", default=DEFAULT_CLUSTER, metavar="NAME",
              help="the cluster the runtime is for (its container is fadenstack-NAME; default: default)")

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
    per_cluster = False         # one runtime per machine, whatever the cluster

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

    # Ray runs among the machine's own processes and sees the machine's paths.

    def ray_temp_dir(self, store: str) -> str:
        return temp_dir(store)

    def host_path(self, store: str, path: str) -> str:
        return path

    def processes(self) -> list:
        return rayproc.machine_processes()

    def is_up(self) -> bool:
        return True

    def status(self):
        return None


def check_cluster(cluster: str) -> str:
    if not isinstance(cluster, str) or not CLUSTER_RE.match(cluster):
        raise AgentError(BAD_INPUT, "--cluster must be 1 to 63 lowercase letters, digits and dashes, not "
                                    "starting or ending with a dash, got %r" % (cluster,))
    return cluster


def load_driver(config=None, requested=None, cluster: str = DEFAULT_CLUSTER, manifest=None):
    """The machine's runtime driver (``chosen_driver``), or ``AgentError(not_retryable)``."""
    if config is None:
        config = load_machine_config()
    name = chosen_driver(config, requested)
    if name is None:
        raise AgentError(NOT_RETRYABLE, NO_RUNTIME)
    if name == ProcessDriver.name:
        return ProcessDriver.from_config(config)
    if name in ENGINES:
        manifest = manifest or {}
        return ContainerDriver.from_config(name, config, cluster, image_executable(manifest, "ray"),
                                           image_executable(manifest, "python"))
    raise AgentError(NOT_RETRYABLE, "Unknown runtime driver %r in the machine config (known: %s)"
                     % (name, ", ".join(DRIVER_NAMES)))


def recorded_driver(store: str, config=None):
    """The driver that started this machine's runtime (``state.json``), or None."""
    state = read_state(store)
    name = state.get("driver")
    if name not in DRIVER_NAMES:
        return None
    if config is None:
        config = load_machine_config()
    # Ray's TLS: on for a cluster whose certificates are installed here (``tlsfiles``); Ray's commands
    # and the container's ``-e NAME`` take the variables from this process's environment.
    export_ray_tls(state.get("cluster"), in_container=name != ProcessDriver.name)
    if name == ProcessDriver.name:
        return ProcessDriver.from_config(config)
    return ContainerDriver.from_config(name, config, state.get("cluster") or DEFAULT_CLUSTER,
                                       state.get("ray"), state.get("python"))


def require_started(store: str, config=None):
    """For ``ray start-head`` / ``ray join``: the driver, with the runtime started."""
    if config is None:
        config = load_machine_config()
    state = read_state(store)
    if state.get("state") != "started":
        if chosen_driver(config) is not None:
            load_driver(config)             # a mistake in the machine config comes first
        raise AgentError(NOT_RETRYABLE, "The runtime is not started on this machine: run `runtime start "
                                        "--digest D` first (after `image load`)")
    driver = recorded_driver(store, config)
    driver.check()
    return driver


def current_driver(store: str, config=None):
    """The started runtime's driver, else the machine's (for ``ray status``)."""
    if config is None:
        config = load_machine_config()
    if read_state(store).get("state") == "started":
        return recorded_driver(store, config)
    return load_driver(config)


def _checked_loaded(store: str, digest: str, driver) -> dict:
    """The loaded image's record, which must be D's (and in the engine, for a container driver)."""
    loaded = read_loaded(store)
    if not loaded or not loaded.get("digest"):
        raise AgentError(NOT_RETRYABLE, "No runtime image is loaded on this machine: run `image load "
                                        "--digest %s` first" % digest)
    if loaded.get("digest") != digest:
        raise AgentError(NOT_RETRYABLE, "The loaded runtime image is %s, not %s: run `image load --digest "
                                        "%s` first" % (str(loaded.get("digest"))[:12], digest[:12], digest))
    if driver.per_cluster and (loaded.get("driver") != driver.name or not loaded.get("image_ref")
                               or not has_image(driver.engine, loaded["image_ref"])):
        raise AgentError(NOT_RETRYABLE, "The runtime image %s is not loaded into %s on this machine: run "
                                        "`image load --digest %s --driver %s` first"
                         % (digest[:12], driver.name, digest, driver.name))
    return loaded


# ------------------------------------------------------------------ commands


# The runtime container's make: 1 since agent 0.10 (no capability, the store read-only, the cluster's
# secrets mounted). A container made before is replaced at the next start (Ray is stopped by then: a
# restart and a repair stop it first), so that Ray finds its token.
CONTAINER_MAKE = 1


def _same_runtime(state: dict, driver, digest: str, cluster: str) -> bool:
    return (state.get("state") == "started" and state.get("digest") == digest
            and state.get("driver") == driver.name
            and (not driver.per_cluster or (state.get("cluster") == cluster
                                            and state.get("container_make") == CONTAINER_MAKE)))


@command("runtime", "start", args=[
    STORE, arg("--digest", required=True, metavar="SHA256", help="the loaded runtime image's sha256"),
    CLUSTER, DRIVER])
def cmd_start(args, out) -> int:
    """``runtime start --digest D [--cluster NAME] [--driver docker|podman|process]
    [--store PATH]``: start the runtime of the loaded image D for the cluster.

    With ``docker`` / ``podman``: removes the containers other clusters left on
    this machine and runs ``fadenstack-<cluster>`` (Ray starts in it with ``ray
    start-head`` / ``ray join``).  With ``process``: records the runtime as
    started.  Result: ``{"driver", "cluster", "container": name | null,
    "image": the engine's reference | null, "removed": [containers of other
    clusters], "digest", "manifest", "already_running": bool, "replaced":
    previous digest | null}``.  Errors (``not_retryable``): no driver, the
    engine or the driver's executables missing, D not the loaded image, another
    runtime running Ray, the container stopping at once (with its last log
    lines); a bad ``--cluster``: ``bad_input``.
    """
    digest = check_digest(args.digest)
    cluster = check_cluster(args.cluster)
    store = store_dir(args.store)
    config = load_machine_config()
    loaded = read_loaded(store)
    manifest = loaded.get("manifest") if isinstance(loaded.get("manifest"), dict) else {}
    driver = load_driver(config, args.driver, cluster, manifest if loaded.get("digest") == digest else None)
    driver.check()
    loaded = _checked_loaded(store, digest, driver)
    image = loaded.get("image_ref") if driver.per_cluster else None
    container = driver.container if driver.per_cluster else None
    state = read_state(store)
    if _same_runtime(state, driver, digest, cluster) and driver.is_up():
        return out.result(driver=driver.name, cluster=cluster, container=container, image=image, removed=[],
                          digest=digest, manifest=manifest, already_running=True, replaced=None)
    replaced = None
    if state.get("state") == "started":
        temp, procs = rayproc.ray_view(store, driver)
        if rayproc.local_node(temp, procs=procs) is not None:
            raise AgentError(NOT_RETRYABLE, "The runtime of image %s is running Ray on this machine: "
                                            "`runtime stop` it before starting %s"
                             % (str(state.get("digest"))[:12], digest[:12]))
        replaced = state.get("digest")
    started = driver.start(image, store, manifest, config, out) if driver.per_cluster else {}
    write_json(state_path(store), {"state": "started", "driver": driver.name, "cluster": cluster,
                                   "container": container, "image": image,
                                   "container_make": CONTAINER_MAKE if driver.per_cluster else None,
                                   "ray": driver.ray, "python": driver.python, "digest": digest,
                                   "manifest": manifest, "started_at": round(time.time(), 3),
                                   "stopped_at": None})
    out.log("runtime %s of image %s started (%s driver%s)"
            % (manifest.get("version", "?"), digest[:12], driver.name,
               ", container %s" % container if container else ""))
    return out.result(driver=driver.name, cluster=cluster, container=container, image=image,
                      removed=started.get("removed", []), digest=digest, manifest=manifest,
                      already_running=False, replaced=replaced)


@command("runtime", "stop", args=[STORE])
def cmd_stop(args, out) -> int:
    """``runtime stop [--store PATH]``: end the runtime's copies, stop Ray (as
    ``ray stop``), then the runtime: the runtime container is stopped and
    removed (which ends the copies in it; the ``process`` driver's are stopped
    first).  The copies' records are cleared.

    Result: ``{"stopped": true, "was_started": bool, "digest", "ray": {the
    result of ray stop}, "container": name | null, "container_removed":
    bool, "copies": [ids of the copies ended]}``.  Running it again is a no-op.
    """
    store = store_dir(args.store)
    state = read_state(store)
    config = load_machine_config()
    driver = recorded_driver(store, config)
    in_container = driver is not None and driver.per_cluster
    # Copies may run on Ray (--distributed-executor-backend ray): they end before it.
    copies = [] if in_container else copyproc.stop_all(store, config, container_gone=False, out=out)
    ray_result = raystop.stop_locked(store, out, driver)
    removed = driver.stop(out) if in_container else False
    if in_container:
        copies = copyproc.stop_all(store, config, container_gone=True, out=out)   # they ended with it
    was_started = state.get("state") == "started"
    if was_started:
        state.update(state="stopped", stopped_at=round(time.time(), 3))
        write_json(state_path(store), state)
    return out.result(stopped=True, was_started=was_started, digest=state.get("digest"), ray=ray_result,
                      container=state.get("container"), container_removed=removed, copies=copies)


@command("runtime", "status", args=[STORE])
def cmd_status(args, out) -> int:
    """``runtime status [--store PATH]``: the runtime and the Ray node it runs.

    Result: ``{"driver": {"name", ...} | null, "driver_error": text | null,
    "state": "started"|"stopped"|"none", "cluster", "digest", "manifest",
    "started_at", "loaded_digest", "container": {"name", "state":
    "running"|"exited"|"created"|...|"absent", "exit_code", "log": its last
    lines when not running} | null, "ray": {"running", "role", "address",
    "gcs_address", "node_id", "pids"}}`` (from the local processes; ``ray
    status`` asks Ray).
    """
    store = store_dir(args.store)
    state = read_state(store)
    try:
        driver = recorded_driver(store) or load_driver()
        description, problem = driver.describe(), None
    except AgentError as exc:
        driver, description, problem = None, None, exc.message
    loaded = read_loaded(store)
    return out.result(driver=description, driver_error=problem, state=state.get("state") or "none",
                      cluster=state.get("cluster"), digest=state.get("digest"), manifest=state.get("manifest"),
                      started_at=state.get("started_at"), loaded_digest=loaded.get("digest"),
                      container=driver.status() if driver is not None else None,
                      ray=rayproc.local_summary(store, driver))
