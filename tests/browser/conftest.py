"""A whole console in processes of its own (tests/processes.py) on the test database, and Chromium."""
import os
import threading

import pytest

from tests import chromium as browsers
from tests.processes import console_processes

os.environ.setdefault("DJANGO_ALLOW_ASYNC_UNSAFE", "true")  # Playwright's sync API runs an event loop
PASSWORD = "a-browser-test-password"


@pytest.fixture(scope="session")
def loopback_hub_url():
    """A lab hub on loopback for the consoles' downloads (the namespaces' lab is not needed for them)."""
    from lab import hub_models
    from lab.hub import HubServer

    server = HubServer("127.0.0.1", 0, cache_dir=hub_models.default_cache_dir())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.url
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def console_options(loopback_hub_url) -> dict:
    """What the console's processes get: a test module overrides this (beat, shortened intervals)."""
    return {"env": {"FADEN_TEST_HF_ENDPOINT": loopback_hub_url}}


@pytest.fixture(scope="module")
def console_processes_of_module(console_options, django_db_setup):
    """Daphne and a worker (and beat, when the module asks), started once for the module's tests."""
    if not os.path.exists(browsers.CHROMIUM):
        pytest.skip("browser tests need Chromium (apt-get install chromium)")
    with console_processes(**console_options) as processes:
        yield processes


@pytest.fixture
def console(console_processes_of_module, transactional_db):
    """The console's URL; its web server and worker see what the test writes (committed)."""
    from tests.factories import UserFactory

    admin = UserFactory(username="admin")
    admin.set_password(PASSWORD)
    admin.save()
    return console_processes_of_module.url


@pytest.fixture
def chromium(console_processes_of_module):
    """A headless Chromium, closed after the test."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = browsers.launch(playwright)
        yield browser
        browser.close()


@pytest.fixture
def sign_in(console, chromium):
    """A new Chromium page (a browser context of its own) signed in as ``username`` with PASSWORD."""

    def signed_in(username: str):
        return browsers.signed_in(chromium, console, username, PASSWORD)

    return signed_in


@pytest.fixture
def page(sign_in):
    """A Chromium page signed in as the administrator."""
    return sign_in("admin")


@pytest.fixture
def gateway_redis():
    """The gateway's Redis under the prefix this run's consoles read: (client, prefix); the figures and usage the
    test recorded there deleted after."""
    from django.conf import settings

    from deployments.gateway import traffic

    client, prefix = traffic.redis_client(settings.REDIS_URL), settings.FADEN_GATEWAY_REDIS_PREFIX
    yield client, prefix
    for pattern in (f"{prefix}:traffic:*", f"{prefix}:usage:*"):
        if names := list(client.scan_iter(pattern)):
            client.delete(*names)
