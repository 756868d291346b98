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


@contextlib.contextmanager
def agents_listener(env: dict | None = None):
    """The agents' TLS listener (faden serve's command line) on every address, on the test database: its port."""
    from console.management.commands.serve import agents_argv

    port = free_port()
    full_env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings", "DATABASE_URL": database_url(),
                "FADEN_LOG_LEVEL": "WARNING", **(env or {})}
    process = subprocess.Popen(agents_argv(sys.executable, bind="0.0.0.0", port=port), env=full_env)
    try:
        wait_for_port(port, process)
        yield port
    finally:
        process.terminate()
        try:
            process.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


STOP_GRACE = 5.0  # seconds the console's processes are given to end at the end of their tests


class Console:
    """The processes, and the worker's controls: a test may kill the worker and start another."""

    def __init__(self, *, env: dict, port: int, queue: str):
        self.env, self.port, self.queue = env, port, queue
        self.url = f"http://127.0.0.1:{port}"
        self.processes: list[subprocess.Popen] = []
        self.worker: subprocess.Popen | None = None
        self.web = self.beat = self.gateway = self.agents = None
        self.gateway_port: int | None = None
        self.gateway_url = ""

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

    def start_beat(self) -> None:
        schedule = os.path.join(tempfile.mkdtemp(prefix="fadenstack-beat-"), "schedule")
        self.beat = self.spawn(["-m", "celery", "-A", "config", "beat", "-l", "WARNING", "-s", schedule])

    def start_gateway(self) -> None:
        from console.management.commands.serve import gateway_argv

        port = self.gateway_port or free_port()
        self.gateway = self.spawn(gateway_argv(sys.executable, bind="127.0.0.1", port=port, workers=1)[1:])
        self.gateway_port, self.gateway_url = port, f"http://127.0.0.1:{port}"
        wait_for_port(port, self.gateway)

    def start_agents(self, port: int) -> None:
        """The agents' TLS listener, as faden serve starts it; not waited for here (``console_processes``
        waits once the worker started, so that the two start side by side)."""
        from console.management.commands.serve import agents_argv

        self.agents = self.spawn(agents_argv(sys.executable, bind="0.0.0.0", port=port)[1:])

    def start_web(self) -> None:
        self.web = self.spawn(["-m", "daphne", "-v", "0", "-b", "0.0.0.0", "-p", str(self.port), "config.asgi:application"])
        wait_for_port(self.port, self.web)

    def restart(self, *names: str) -> None:
        """Stop these processes (web, worker, beat, gateway) as a restart would (SIGTERM), then start them again."""
        for name in names:
            process = getattr(self, name)
            process.terminate()
            process.wait(timeout=30)
            {"web": self.start_web, "worker": self.start_worker, "beat": self.start_beat, "gateway": self.start_gateway}[name]()

    def kill_worker(self) -> None:
        """As a crash would: SIGKILL, no warm shutdown, its tasks unacknowledged."""
        self.worker.send_signal(signal.SIGKILL)
        self.worker.wait(timeout=10)

    def stop(self) -> None:
        """At the end of its tests: SIGTERM, and SIGKILL for what has not ended within STOP_GRACE s (a
        worker's warm shutdown would wait for its tasks, a health check's SSH included; nobody reads
        their results any more)."""
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        deadline = time.monotonic() + STOP_GRACE
        for process in self.processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


@contextlib.contextmanager
def console_processes(*, beat: bool = False, env: dict | None = None, enqueue: bool = False, worker: bool = True,
                      gateway: bool = False):
    """Daphne on every address (the lab's machines post heartbeats to it), one worker on a queue of
    its own (unless ``worker`` is false), and beat and the gateway when asked (the gateway on loopback,
    at ``gateway_url``). With ``enqueue`` the test process sends its tasks to that worker instead of
    running them eagerly."""
    from django.conf import settings

    from config.celery import app

    port, tls_port = free_port(), free_port()
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
        "FADEN_AGENT_TLS_URL": f"https://198.18.0.1:{tls_port}",  # the agents' listener, started below
        "FADEN_LOG_LEVEL": "WARNING",
        **(env or {}),
    }
    console = Console(env=full_env, port=port, queue=queue)
    eager, default_queue = app.conf.task_always_eager, app.conf.task_default_queue
    agents_url = settings.FADEN_AGENT_TLS_URL  # tasks run here too (eagerly): they give the agents this listener
    settings.FADEN_AGENT_TLS_URL = full_env["FADEN_AGENT_TLS_URL"]
    if enqueue:
        app.conf.task_always_eager, app.conf.task_default_queue = False, queue
    try:
        console.start_agents(tls_port)  # first: it starts while the others do
        console.start_web()
        if worker:
            console.start_worker()
        if beat:
            console.start_beat()
        if gateway:
            console.start_gateway()
        wait_for_port(tls_port, console.agents)
        yield console
    finally:
        app.conf.task_always_eager, app.conf.task_default_queue = eager, default_queue
        settings.FADEN_AGENT_TLS_URL = agents_url
        console.stop()
