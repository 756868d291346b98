"""Which processes use this machine's GPUs, and whether the console started
them (agent 0.9): ``facts`` reports them, and so does the heartbeat, so that
the console's placement sees a person's own job on a GPU within a minute.

The list is the vendor tool's list of compute processes (``nvidia-smi
--query-compute-apps``: every process holding a CUDA context, with the GPU's
uuid and its memory), one entry per process and GPU::

    {"gpu_uuid": "GPU-...", "pid": 4121, "used_memory_mib": 2048, "console": false}

``console`` is true for the processes of the copies this agent started: each
copy's engine (or its Ray node) as its record names it (``host_pid`` with its
start time, so a pid used again by another process is not taken for it) and
every process under it (vLLM's workers, Ray's workers of a spanning copy).
Everything else is a process the console did not start: a person's job.

AMD's tool is not asked yet: a machine with AMD GPUs reports no list (null).
"""

import os
import time

from .files import read_json, store_dir
from .parsers import ToolOutputError, parse_nvidia_compute_apps
from .rayproc import read_proc

COMPUTE_APPS = ["nvidia-smi", "--query-compute-apps=gpu_uuid,pid,used_memory", "--format=csv,noheader,nounits"]
MAX_PROCESSES = 64          # a heartbeat's body is read up to 16 KiB; each entry is about 100 bytes
READ_EVERY = 10.0           # seconds between two reads by the heartbeat (nvidia-smi costs tens of ms)
# copyproc.copies_dir's folder: copyproc is not imported, since its engines module imports facts, which imports this.
COPIES = "copies"


def copy_pids(store: str) -> set:
    """This machine's pids of the copies' processes: each recorded engine or Ray node that still runs
    as itself, and every process under it."""
    try:
        names = os.listdir(os.path.join(store, COPIES))
    except OSError:
        return set()
    roots = {}
    for name in names:
        if name.endswith(".json") and not name.startswith("."):
            record = read_json(os.path.join(store, COPIES, name)) or {}
            if isinstance(record.get("host_pid"), int):
                roots[record["host_pid"]] = record.get("start_ticks")
    if not roots:
        return set()
    children, alive = {}, set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            proc = read_proc(int(entry))
            if proc is not None:
                children.setdefault(proc.ppid, []).append(proc.pid)
                if proc.pid in roots and proc.start == roots[proc.pid]:
                    alive.add(proc.pid)
    taken, todo = set(), list(alive)
    while todo:
        pid = todo.pop()
        if pid not in taken:
            taken.add(pid)
            todo += children.get(pid, [])
    return taken


def mark(processes: list, console: set) -> list:
    """The processes with ``console`` set, at most ``MAX_PROCESSES`` (the console's own last: a person's
    job is what the list must not lose)."""
    marked = [dict(p, console=p["pid"] in console) for p in processes]
    marked.sort(key=lambda p: (p["console"], p["gpu_uuid"], p["pid"]))
    return marked[:MAX_PROCESSES]


def read(run, store: str) -> tuple:
    """``(processes or None, warning or None)``: None without nvidia-smi; a tool that failed or printed
    what is not the list gives None and its reason. ``run(argv)`` is facts' ``run_tool``."""
    done = run(COMPUTE_APPS)
    if done is None:
        return None, None
    if not done.ok:
        if done.rc is not None and "no devices were found" in (done.stdout + done.stderr).lower():
            return [], None
        return None, done.describe_failure()
    try:
        processes = parse_nvidia_compute_apps(done.stdout)
    except ToolOutputError as exc:
        return None, "nvidia-smi --query-compute-apps: %s" % exc
    return mark(processes, copy_pids(store) if processes else set()), None


class GpuWatch:
    """Kept by the heartbeat loop: ``report()`` is the list when it was read on this beat (at most every
    ``READ_EVERY`` s), else None and the beat carries none (the console keeps what it has)."""

    def __init__(self, run, store=None, every: float = READ_EVERY, clock=time.monotonic):
        self.run, self.store, self.every, self.clock = run, store, every, clock
        self.last_read = None
        self.error = None           # why the last read gave nothing, or None
        self.absent = False         # no nvidia-smi here: asked again only every ten reads' time

    def report(self):
        now = self.clock()
        wait = self.every * (10 if self.absent else 1)
        if self.last_read is not None and now - self.last_read < wait:
            return None
        self.last_read = now
        try:
            processes, self.error = read(self.run, store_dir(self.store))
        except Exception as exc:  # noqa: BLE001 - a beat must go out whatever this finds
            processes, self.error = None, "%s: %s" % (type(exc).__name__, exc)
        self.absent = processes is None and self.error is None
        return processes
