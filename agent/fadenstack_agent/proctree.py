"""A run's processes as a tree, for ending every one of them (``allreduce``).

Open MPI puts each rank in a process group of its own, and a daemon or rank whose parent was killed
is handed to init: neither a process group nor the tree found after a SIGKILL holds them all. So the
tree is taken while it stands (``snapshot``: a process and its descendants, each with its start
time), and what of it is still alive afterwards is killed (``kill_left``; the start time tells a
pid used again by another process). Processes in a container are found by their pid there
(``host_pid``): the machine's /proc shows them, under the machine's pids.
"""

import os
import signal

from .rayproc import namespace_pids, read_proc


def _table() -> dict:
    """pid -> Proc of every live process."""
    found = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            proc = read_proc(int(name))
            if proc is not None:
                found[proc.pid] = proc
    return found


def snapshot(root: int) -> dict:
    """``{pid: start ticks}`` of ``root`` and every descendant, as they are now."""
    table = _table()
    if root not in table:
        return {}
    children = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    taken, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in taken or pid not in table:
            continue
        taken[pid] = table[pid].start
        todo += children.get(pid, [])
    return taken


def kill_left(taken: dict, sig=signal.SIGKILL) -> list:
    """Send ``sig`` to each process of a snapshot still alive as itself; the pids signalled."""
    signalled = []
    for pid, start in taken.items():
        proc = read_proc(pid)
        if proc is None or proc.start != start:
            continue
        try:
            os.kill(pid, sig)
            signalled.append(pid)
        except OSError:
            pass
    return signalled


def host_pid(inner: int, anchor: int):
    """The machine's pid of the process that is ``inner`` in the pid namespace of ``anchor`` (a
    container's first process), or None."""
    for pid in namespace_pids(anchor):
        try:
            with open("/proc/%d/status" % pid) as handle:
                ids = next((line.split()[1:] for line in handle if line.startswith("NSpid:")), [])
        except OSError:
            continue
        if ids and ids[-1] == str(inner):
            return pid
    return None
