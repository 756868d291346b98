"""This machine's Ray, for ``ray``: its processes (found in /proc, never by
Ray's own ``ray stop``, which kills every Ray process it can see: lab machines
share one process table), the agent's record of what it started
(``<store>/runtime/ray.json``), the lock, and local network checks.  Stopping
those processes is ``raystop``.
"""

import errno
import ipaddress
import os
import socket
import stat

from .files import Locked, read_json, runtime_dir, write_json
from .protocol import ADDRESS_IN_USE, NOT_RETRYABLE, RETRYABLE, UNREACHABLE, AgentError
from .rayargs import (CONNECT_TIMEOUT, LOCK_WAIT, START_TIMEOUT, build_address, in_use_words,
                      port_taken_in_logs, summarize_failure, temp_dir)


# ------------------------------------------------------------------ this machine's Ray processes


class Proc:
    def __init__(self, pid, ppid, sid, state, start, argv):
        self.pid, self.ppid, self.sid, self.state, self.start, self.argv = pid, ppid, sid, state, start, argv

    @property
    def cmdline(self) -> str:
        return " ".join(self.argv)

    def flag(self, name: str):
        """The value of ``--name=value`` in the argv, or None."""
        prefix = name + "="
        for arg in self.argv:
            if arg.startswith(prefix):
                return arg[len(prefix):]
        return None


def _read(path: str, mode: str = "rb"):
    try:
        with open(path, mode) as fh:
            return fh.read()
    except OSError:
        return None


def namespace_pids(anchor: int) -> list:
    """This machine's pids of the processes in the pid namespace of ``anchor`` (a container's first
    process); [] when ``anchor`` is gone."""
    try:
        namespace = os.readlink("/proc/%d/ns/pid" % anchor)
    except OSError:
        return []
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.readlink("/proc/%s/ns/pid" % name) == namespace:
                found.append(int(name))
        except OSError:
            continue
    return found


def read_proc(pid: int):
    """One process from /proc (None when gone or a zombie)."""
    stat = _read("/proc/%d/stat" % pid)
    raw = _read("/proc/%d/cmdline" % pid)
    if stat is None or raw is None:
        return None
    try:
        fields = stat.decode("ascii", "replace").rsplit(")", 1)[1].split()
        state, ppid, sid, start = fields[0], int(fields[1]), int(fields[3]), int(fields[19])
    except (IndexError, ValueError):
        return None
    if state in ("Z", "X"):
        return None
    argv = [part.decode("utf-8", "replace") for part in raw.split(b"\0") if part]
    return Proc(pid, ppid, sid, state, start, argv)


def _namespaces(pid) -> tuple:
    links = []
    for kind in ("net", "mnt"):
        try:
            links.append(os.readlink("/proc/%s/ns/%s" % (pid, kind)))
        except OSError:
            return ()
    return tuple(links)


def machine_processes() -> list:
    """Processes of this machine: the network and mount namespaces we are in
    (in the lab every machine is such a pair, sharing one process table), not
    this agent or its ancestors."""
    own = _namespaces("self")
    if not own:
        return []
    skip = set()
    pid = os.getpid()
    while pid > 1 and pid not in skip:
        skip.add(pid)
        proc = read_proc(pid)
        pid = proc.ppid if proc else 0
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in skip:
            continue
        if _namespaces(name) != own:
            continue
        proc = read_proc(int(name))
        if proc is not None and proc.argv:
            found.append(proc)
    return found


RAY_PATH_PARTS = ("/ray/_private/", "/ray/dashboard/", "/ray/autoscaler/", "/ray/util/", "/ray/core/src/")
RAY_BINARIES = ("raylet", "gcs_server", "plasma_store")


def is_ray_process(proc) -> bool:
    """Ray's daemons, workers and CLI (not, say, a `tail` of Ray's logs)."""
    argv = proc.argv
    if not argv:
        return False
    if argv[0].startswith("ray::") or os.path.basename(argv[0]) in RAY_BINARIES:
        return True
    if any(part in arg for arg in argv[1:4] for part in RAY_PATH_PARTS):
        return True
    if "ray.util.client.server" in argv[1:4]:
        return True
    launcher = [os.path.basename(arg) for arg in argv[:2]]
    return "ray" in launcher and "start" in argv[1:3]


def mentions_dir(proc, directory: str) -> bool:
    directory = directory.rstrip("/")
    for arg in proc.argv:
        value = arg.split("=", 1)[1] if arg.startswith("-") and "=" in arg else arg
        if value == directory or value.startswith(directory + "/"):
            return True
    return False


def ray_processes(temp: str, sids=(), procs=None) -> list:
    """This machine's Ray processes that belong to the Ray under ``temp``: Ray
    processes naming the temp dir, of a session the agent started (``sids``),
    or descending from either (workers show only ``ray::IDLE``)."""
    procs = machine_processes() if procs is None else procs
    sids = set(sids or ())
    by_pid = {p.pid: p for p in procs}
    ours = {p.pid for p in procs if is_ray_process(p) and (mentions_dir(p, temp) or p.sid in sids)}
    for proc in procs:
        if proc.pid in ours or not is_ray_process(proc):
            continue
        seen, parent = set(), by_pid.get(proc.ppid)
        while parent is not None and parent.pid not in seen:
            if parent.pid in ours:
                ours.add(proc.pid)
                break
            seen.add(parent.pid)
            parent = by_pid.get(parent.ppid)
    return sorted((by_pid[pid] for pid in ours), key=lambda p: p.pid)


def node_from_processes(procs: list, temp: str):
    """The Ray node under ``temp`` as its raylet's argv says, or None."""
    for proc in procs:
        if os.path.basename(proc.argv[0]) == "raylet" and (proc.flag("--temp_dir") or "").rstrip("/") == \
                temp.rstrip("/"):
            return {"pid": proc.pid, "node_id": proc.flag("--node_id"),
                    "node_ip": proc.flag("--node_ip_address"), "gcs_address": proc.flag("--gcs-address"),
                    "head": "--head" in proc.argv}
    return None


def ray_view(store: str, driver=None) -> tuple:
    """``(temp, procs)``: Ray's temp dir as Ray sees it, and the processes Ray
    runs among.  The runtime driver knows both (a container's Ray sees the
    store at its mount point); without one, the machine's, as the process
    driver's."""
    if driver is None:
        return temp_dir(store), machine_processes()
    return driver.ray_temp_dir(store), driver.processes()


def local_node(temp: str, sids=(), procs=None):
    return node_from_processes(ray_processes(temp, sids, procs), temp)


def local_summary(store: str, driver=None) -> dict:
    """For ``runtime status``: the local Ray node, from the processes only."""
    temp, procs = ray_view(store, driver)
    procs = ray_processes(temp, read_record(store).get("sids", ()), procs)
    node = node_from_processes(procs, temp)
    return {"running": node is not None, "role": (("head" if node["head"] else "worker") if node else None),
            "address": node["node_ip"] if node else None,
            "gcs_address": node["gcs_address"] if node else None,
            "node_id": node["node_id"] if node else None, "pids": [p.pid for p in procs]}


# ------------------------------------------------------------------ records and locks


def record_path(store: str) -> str:
    return os.path.join(runtime_dir(store), "ray.json")


def read_record(store: str) -> dict:
    return read_json(record_path(store)) or {}


def write_record(store: str, **fields) -> dict:
    data = read_record(store)
    data.update(fields)
    write_json(record_path(store), data)
    return data


def ray_lock(store: str, wait: float = LOCK_WAIT) -> Locked:
    """``with ray_lock(store):`` one Ray-changing command at a time on a machine
    (``<store>/runtime/ray.lock``)."""
    return Locked(os.path.join(runtime_dir(store), "ray.lock"), wait,
                  "another ray command has been running on this machine for %d s" % wait)


# ------------------------------------------------------------------ network checks


def _family(host: str):
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def check_local_address(address: str) -> None:
    """``address`` must be one of this machine's (a bind to port 0 tells)."""
    sock = socket.socket(_family(address), socket.SOCK_STREAM)
    try:
        sock.bind((address, 0))
    except OSError as exc:
        raise AgentError(NOT_RETRYABLE, "%s is not an address of this machine (%s)"
                         % (address, exc.strerror or exc))
    finally:
        sock.close()


def port_holder_message(address: str, port: int):
    """None when Ray's GCS could bind ``port`` (on ``address`` and on the
    wildcard address it actually binds), else the reason in the OS's words."""
    wildcard = "::" if ":" in address else "0.0.0.0"
    for host in (address, wildcard):
        sock = socket.socket(_family(host), socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as gRPC does
        try:
            sock.bind((host, port))
        except OSError as exc:
            words = exc.strerror or str(exc)
            if exc.errno == errno.EADDRINUSE:
                where = address if host == address else "%s, the wildcard address Ray's GCS binds" % host
                return "%s (port %d on %s)" % (words, port, where)
            return "%s (port %d on %s)" % (words, port, host)
        finally:
            sock.close()
    return None


def check_reachable(host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> None:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return
    except socket.timeout:
        reason = "no answer within %g s" % timeout
    except OSError as exc:
        reason = exc.strerror or str(exc)
    raise AgentError(UNREACHABLE, "Cannot reach the Ray head at %s from this machine: %s"
                     % (build_address(host, port), reason))


def resolve_head(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0]
    except (OSError, IndexError) as exc:
        raise AgentError(UNREACHABLE, "Cannot resolve the Ray head's name %r: %s" % (host, exc))


# ------------------------------------------------------------------ Ray's logs


def read_tail(path: str, limit: int = 65536) -> str:
    """The last ``limit`` bytes of a file as text ('' when it cannot be read).  Never through a link
    (``O_NOFOLLOW``), and only a regular file: the runtime container can write Ray's temp dir and the
    copies' logs, and must not make the agent read another file of the machine into an answer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        with os.fdopen(fd, "rb") as fh:
            if not stat.S_ISREG(os.fstat(fh.fileno()).st_mode):
                return ""
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - limit))
            return fh.read().decode("utf-8", "replace")
    except OSError:
        return ""


def session_dir(store: str, driver=None):
    """The latest Ray session's directory on this machine, or None.  Ray's
    ``session_latest`` link names it by Ray's own path: in a container, a path
    under the store's mount point, which the driver turns into the store's."""
    link = os.path.join(temp_dir(store), "session_latest")
    try:
        target = os.path.join(os.path.dirname(link), os.readlink(link))
    except OSError:
        return None
    target = driver.host_path(store, target) if driver is not None else target
    # Written where the runtime container can write: only a session inside the temp dir counts.
    inside = os.path.realpath(temp_dir(store)) + os.sep
    return target if os.path.realpath(target).startswith(inside) else None


def start_failure(store: str, code, output: str, address: str, port, since: float = 0.0,
                  driver=None) -> AgentError:
    """What a failed ``ray start`` means, in Ray's words (its output, and the
    logs of the session it made, if it got that far: made after ``since``)."""
    session = session_dir(store, driver) or os.path.join(temp_dir(store), "session_latest")
    try:
        fresh = os.path.getmtime(session) >= since - 1
    except OSError:
        fresh = False
    logs = os.path.join(session, "logs")
    gcs, raylet = ("".join(read_tail(os.path.join(logs, "%s.%s" % (name, ext))) for ext in ("err", "out"))
                   if fresh else "" for name in ("gcs_server", "raylet"))
    if port_taken_in_logs(output, gcs, raylet):
        words = in_use_words(output, gcs, raylet) or summarize_failure(output)
        where = "port %d on %s" % (port, address) if port else "a port on %s" % address
        return AgentError(ADDRESS_IN_USE, "Address already in use (%s); Ray: %s" % (where, words))
    if code is None:
        return AgentError(RETRYABLE, "ray start did not finish within %d s: %s"
                          % (START_TIMEOUT, summarize_failure(output)))
    return AgentError(RETRYABLE, "ray start failed (exit status %s): %s" % (code, summarize_failure(output)))
