"""A whole console in processes of its own (Daphne and a Celery worker) on the test database, and Chromium."""
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid

import pytest

from tests.lab_fixtures import lab, lab_dir, lab_machine  # noqa: F401

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
PASSWORD = "a-browser-test-password"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _database_url() -> str:
    from django.db import connection

    db = connection.settings_dict
    if db["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{db['NAME']}"
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def _wait_for_port(port: int, process: subprocess.Popen, timeout: float = 30) -> None:
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


@pytest.fixture
def console(transactional_db, settings):
    """The console's URL; its web server and worker see what the test writes (committed)."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("browser tests need Chromium (apt-get install chromium)")
    from console.celery import app
    from tests.factories import UserFactory

    admin = UserFactory(username="admin")
    admin.set_password(PASSWORD)
    admin.save()
    port = _free_port()
    queue = f"fadenstack-test-{uuid.uuid4().hex[:8]}"
    worker_name = f"{queue}@{socket.gethostname()}"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        "DATABASE_URL": _database_url(),
        "FADEN_CELERY_EAGER": "0",
        "FADEN_CELERY_QUEUE": queue,
        "FADEN_CONSOLE_URL": f"http://198.18.0.1:{port}",
        "FADEN_LOG_LEVEL": "WARNING",
    }
    web = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "0.0.0.0", "-p", str(port), "console.asgi:application"], env=env
    )
    worker = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "console", "worker", "-P", "threads", "-c", "4", "-Q", queue,
         "-n", worker_name, "-l", "WARNING", "--without-mingle", "--without-gossip"],
        env=env,
    )
    try:
        _wait_for_port(port, web)
        deadline = time.monotonic() + 30
        while not app.control.ping(destination=[worker_name], timeout=0.5):
            if worker.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the Celery worker did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        for process in (web, worker):
            process.terminate()
        for process in (web, worker):
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture
def page(console):
    """A Chromium page signed in as the administrator."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        )
        page = browser.new_page(viewport={"width": 1440, "height": 900}, base_url=console)
        page.set_default_timeout(15000)
        page.goto("/login/")
        page.fill("input[name=username]", "admin")
        page.fill("input[name=password]", PASSWORD)
        page.click("button[type=submit]")
        page.wait_for_url(console + "/")
        yield page
        browser.close()
