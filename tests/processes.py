"""A whole console in processes of its own (Daphne, a Celery worker, and beat when asked) on the
test database: for the browser tests and for the lab tests that need a real worker and beat."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def database_url() -> str:
    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the web server exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    pytest.fail(f"the web server did not listen on {port} within {timeout} s")


class Console:
    """The processes, and the worker's controls: a test may kill the worker and start another."""

    def __init__(self, *, env: dict, port: int, queue: str):
        self.env, self.port, self.queue = env, port, queue
        self.url = f"http://127.0.0.1:{port}"
        self.processes: list[subprocess.Popen] = []
        self.worker: subprocess.Popen | None = None

    def spawn(self, argv: list[str]) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, *argv], env=self.env)
        self.processes.append(process)
        return process

    def start_worker(self, timeout: float = 30) -> None:
        from config.celery import app

        name = f"{self.queue}-{uuid.uuid4().hex[:4]}@{socket.gethostname()}"
        self.worker = self.spawn(["-m", "celery", "-A", "config", "worker", "-P", "threads", "-c", "4", "-Q", self.queue,
                                  "-n", name, "-l", "WARNING", "--without-mingle", "--without-gossip"])
        deadline = time.monotonic() + timeout
        while not app.control.ping(destination=[name], timeout=0.5):
            if self.worker.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the Celery worker did not start")

    def kill_worker(self) -> None:
        """As a crash would: SIGKILL, no warm shutdown, its tasks unacknowledged."""
        self.worker.send_signal(signal.SIGKILL)
        self.worker.wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


@contextlib.contextmanager
def console_processes(*, beat: bool = False, env: dict | None = None, enqueue: bool = False, worker: bool = True):
    """Daphne on every address (the lab's machines post heartbeats to it), one worker on a queue of
    its own (unless ``worker`` is false), and beat when asked. With ``enqueue`` the test process sends
    its tasks to that worker instead of running them eagerly."""
    from django.conf import settings

    from config.celery import app

    port = free_port()
    queue = f"fadenstack-test-{uuid.uuid4().hex[:8]}"
    full_env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": database_url(),
        "FADEN_CELERY_EAGER": "0",
        "FADEN_CELERY_QUEUE": queue,
        # The test process is part of the same console: what it pushes reaches the console's sockets.
        "FADEN_LIVE_PREFIX": settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"],
        "FADEN_CONSOLE_URL": f"http://198.18.0.1:{port}",
        "FADEN_LOG_LEVEL": "WARNING",
        **(env or {}),
    }
    console = Console(env=full_env, port=port, queue=queue)
    eager, default_queue = app.conf.task_always_eager, app.conf.task_default_queue
    if enqueue:
        app.conf.task_always_eager, app.conf.task_default_queue = False, queue
    try:
        web = console.spawn(["-m", "daphne", "-v", "0", "-b", "0.0.0.0", "-p", str(port), "config.asgi:application"])
        wait_for_port(port, web)
        if worker:
            console.start_worker()
        if beat:
            schedule = os.path.join(tempfile.mkdtemp(prefix="fadenstack-beat-"), "schedule")
            console.spawn(["-m", "celery", "-A", "config", "beat", "-l", "WARNING", "-s", schedule])
        yield console
    finally:
        app.conf.task_always_eager, app.conf.task_default_queue = eager, default_queue
        console.stop()
