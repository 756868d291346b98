"""The ``runtime`` section of every heartbeat: is the runtime's container up,
and is this machine's Ray node alive, told cheaply enough to run every beat.

``{"container": "running"|"exited"|"absent"|null, "ray": {"role":
"head"|"worker"|null, "alive": bool|null, "raylet": bool, "head_port_open":
bool|null}}``

- Nothing here asks Ray: no Ray client, no ``ray status``.  The raylet is
  looked for among the processes Ray runs in (``rayproc.node_from_processes``:
  the machine's for the ``process`` driver, the container's pid namespace for
  ``docker`` / ``podman``); on the head, a TCP connect to its own GCS port
  (``PORT_TIMEOUT``) says whether the GCS still listens.
- ``role`` is what ``<store>/runtime/ray.json`` records (``ray start-head`` /
  ``ray join`` write it, ``ray stop`` clears it).  ``alive`` is null when no
  role is recorded (Ray not started, or stopped on purpose); else true when the
  raylet runs and, on the head, the port answers.  So ``alive: false`` means
  Ray was started here and is gone: killed, crashed, or its container ended.
- ``container`` is null for the ``process`` driver and whenever the runtime is
  not started (``state.json``); then every field is null and ``raylet`` false.
- The engine is asked (``<engine> inspect``, 20 to 40 ms for Podman on an
  idle lab host, more on a busy machine) only when it must be: the container's
  first process, as the last inspect named it, is looked at in /proc on every
  beat (microseconds); the engine is asked again when that process is gone (to
  tell ``exited`` from ``absent``), when the runtime changed, and every
  ``INSPECT_EVERY`` beats at the latest.
- Whatever goes wrong here (an unreadable record, an engine that does not
  answer) gives nulls for what is not known, never a failed beat: the reason is
  in ``error`` of the watch, which the heartbeat loop logs.
"""

import socket

from . import rayproc
from .engines import namespace_processes
from .files import load_machine_config, store_dir
from .protocol import AgentError
from .runtime import read_state, recorded_driver

PORT_TIMEOUT = 0.5          # the head's own GCS port, on its own address: an answer is immediate
INSPECT_EVERY = 6           # beats between two engine inspects of a container seen running
ROLES = ("head", "worker")


def not_started() -> dict:
    return {"container": None, "ray": {"role": None, "alive": None, "raylet": False, "head_port_open": None}}


def port_open(host, port, timeout: float = PORT_TIMEOUT) -> bool:
    """A TCP connect to ``host:port`` succeeds within ``timeout`` s (nothing is sent)."""
    try:
        with socket.create_connection((str(host), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError, TypeError):
        return False


class RuntimeWatch:
    """Kept by the heartbeat loop from beat to beat (it remembers the container's process)."""

    def __init__(self, store=None):
        self.store = store
        self.error = None           # why the last report left something unknown, or None
        self._seen = None           # {"container", "pid", "start"} of a container seen running
        self._beats_since_inspect = 0

    def report(self) -> dict:
        self.error = None
        try:
            return self._report()
        except AgentError as exc:
            self.error = exc.message
        except Exception as exc:  # noqa: BLE001 - a beat must go out whatever this finds
            self.error = "%s: %s" % (type(exc).__name__, exc)
        self._seen = None
        return not_started()

    def _report(self) -> dict:
        store = store_dir(self.store)
        if read_state(store).get("state") != "started":
            self._seen = None
            return not_started()
        driver = recorded_driver(store, load_machine_config())
        if driver is None:
            self._seen = None
            return not_started()
        record = rayproc.read_record(store)
        role = record.get("role") if record.get("role") in ROLES else None
        container = None
        if driver.per_cluster:
            container, pid = self._container(driver)
            if container is None:       # the engine did not answer: nothing is known
                return {"container": None,
                        "ray": {"role": role, "alive": None, "raylet": False, "head_port_open": None}}
            procs = namespace_processes(pid) if pid else []
        else:
            procs = driver.processes()
        raylet = rayproc.node_from_processes(procs, driver.ray_temp_dir(store)) is not None
        head_port_open = port_open(record.get("address"), record.get("port")) if role == "head" else None
        alive = (raylet and head_port_open is not False) if role else None
        return {"container": container,
                "ray": {"role": role, "alive": alive, "raylet": raylet, "head_port_open": head_port_open}}

    def _container(self, driver) -> tuple:
        """``(state, pid of its first process or None)``; the engine only when /proc cannot tell."""
        seen = self._seen
        if seen is not None and seen["container"] == driver.container and \
                self._beats_since_inspect < INSPECT_EVERY - 1:
            proc = rayproc.read_proc(seen["pid"])
            if proc is not None and proc.start == seen["start"]:
                self._beats_since_inspect += 1
                return "running", seen["pid"]
        self._seen, self._beats_since_inspect = None, 0
        try:
            state = driver.state()
        except AgentError as exc:
            self.error = exc.message
            return None, None
        if state is None:
            return "absent", None
        if not state["running"] or not state["pid"]:
            return "exited", None
        proc = rayproc.read_proc(state["pid"])
        if proc is not None:
            self._seen = {"container": driver.container, "pid": state["pid"], "start": proc.start}
        return "running", state["pid"]
