"""A test process's PostgreSQL backends run at the process's own priority.

Under ``make test`` the lab's worker runs at normal priority and every other test at niceness 19
(tests/conftest.py), but the queries of those others run in PostgreSQL's backends, which the server
starts at its own priority: on two CPUs a database-heavy unit test then slows the lab's clusters as
much as an un-niced worker would. So each connection's backend is reniced with the process that
opened it (tests/settings.py connects ``follow``; this needs root, as the lab does, and is skipped
otherwise), and again whenever the worker's own priority changes (``renice``).
"""
import os
import threading

_backends: set[int] = set()
_lock = threading.Lock()


def _set(pid: int, niceness: int) -> bool:
    try:
        os.setpriority(os.PRIO_PROCESS, pid, niceness)
    except ProcessLookupError:  # the backend ended with its connection
        return False
    except PermissionError:  # not root (or another host's server): nothing to follow
        pass
    return True


def follow(sender, connection, **kwargs) -> None:
    """Django's ``connection_created``: the new backend at this process's priority, and remembered."""
    if connection.vendor != "postgresql" or connection.settings_dict.get("HOST") not in ("127.0.0.1", "localhost", "", None):
        return
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    if _set(pid, os.getpriority(os.PRIO_PROCESS, 0)):
        with _lock:
            _backends.add(pid)


def renice(niceness: int) -> None:
    """This process's backends (those still there) to ``niceness``, as the process itself was."""
    with _lock:
        for pid in list(_backends):
            if not _set(pid, niceness):
                _backends.discard(pid)


def connect_signal() -> None:
    from django.db.backends.signals import connection_created

    connection_created.connect(follow, dispatch_uid="tests.priority.follow")
