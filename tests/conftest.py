"""Fixtures shared by the unit, API and live tests.

Nothing here is autouse and nothing touches the database unless a test asks
for it: tests/agent and tests/lab run without Django's database. The lab's
fixtures (built once per run) are in tests/lab_fixtures.py.
"""
import os
import uuid

import pytest

from tests import priority

pytest_plugins = ["tests.lab_fixtures"]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The lab's tests first (after pytest-django has put them in its order): under ``make test``
    (``-n 2 --dist loadgroup --no-loadscope-reorder``) their worker starts on them at once, and the
    other worker runs everything else beside them. tests/lab_fixtures.py puts them in one group. The sort is
    stable: within each part, and within each lab module, pytest-django's order holds."""
    grouped = [item for item in items if item.get_closest_marker("xdist_group")]
    if getattr(config.option, "loadgroup", False) and any("@" not in item.nodeid for item in grouped):
        raise pytest.UsageError("pytest-xdist did not group the lab's tests (they would run in two workers at once, "
                                "on one lab): use the pytest version pyproject.toml pins")
    items.sort(key=lambda item: (item.get_closest_marker("xdist_group") is None, LAB_FIRST.get(item.module.__name__, 1)))


# Under `make test` the lab's worker is the suite's critical path, and the two CPUs are shared: every
# other test runs in a worker this much nicer (with the browsers and servers it starts), so that the lab's
# clusters start at full speed and the rest fills the time they spend waiting. Measured on this 2-CPU
# machine, the lab's tests took 2 to 2.7 times as long beside an un-niced worker as alone.
OTHERS_NICENESS = 19


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before each test (and its fixtures) in an xdist worker: the lab's at normal priority, the others nicer."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        wanted = 0 if item.get_closest_marker("xdist_group") else OTHERS_NICENESS
        if os.getpriority(os.PRIO_PROCESS, 0) != wanted:
            try:
                os.setpriority(os.PRIO_PROCESS, 0, wanted)
            except PermissionError:  # not root: back to normal is not allowed, and harmless to skip
                return
            priority.renice(wanted)  # and the PostgreSQL backends doing its queries (tests/priority.py)


# The lab's own tests first: their `fresh_lab` is then the run's first `up` and costs no down and up again.
# Lab modules that mostly wait (on timeouts, heartbeats and Ray's health checks) go next, while the
# other worker keeps the CPUs busy; those that start clusters as fast as the CPUs allow come after.
LAB_FIRST = {"tests.lab.test_lab": -1, "tests.integration.test_cluster_life_lab": 0, "tests.integration.test_enrol_lab": 0}


@pytest.fixture(scope="module")
def module_db(django_db_setup, django_db_blocker):
    """The test database for a module whose tests build on each other (one console, one cluster): open
    for the whole module, not wrapped in a transaction, emptied at its end. Its tests carry no
    ``django_db`` mark (that would empty it after each one)."""
    from django.core.management import call_command
    from django.db import connection
    from django.test.utils import setup_databases, teardown_databases

    with django_db_blocker.unblock():
        # pytest-django makes the test database only when a collected test is marked for it.
        made = None if connection.settings_dict["NAME"] == connection.creation._get_test_db_name() else \
            setup_databases(verbosity=0, interactive=False, aliases={"default"})
        yield
        call_command("flush", interactive=False, verbosity=0)
        if made:
            teardown_databases(made, verbosity=0)


@pytest.fixture
def admin_user(db):
    """The administrator who drives the console: an Administrator through the role's group, as the
    Users page makes one (not a superuser)."""
    from tests.factories import UserFactory

    return UserFactory(username="admin")


@pytest.fixture
def admin_client(client, admin_user):
    """A Django test client signed in as the administrator."""
    client.force_login(admin_user)
    return client


@pytest.fixture
def api_token(admin_user):
    from rest_framework.authtoken.models import Token

    return Token.objects.create(user=admin_user)


@pytest.fixture
def api_client(api_token):
    """A DRF client that sends ``Authorization: Token ...`` like automation does (no session)."""
    from rest_framework.test import APIClient

    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {api_token.key}")
    return client


@pytest.fixture
def anonymous_api_client():
    from rest_framework.test import APIClient

    return APIClient()


@pytest.fixture
def no_ssh(monkeypatch):
    """Fail the test if anything tries to reach a machine over SSH."""
    from machines import remote

    def refuse(*args, **kwargs):
        pytest.fail(f"SSH was reached with {args} {kwargs}; bad input must be refused before that")

    monkeypatch.setattr(remote, "scan_host_key", refuse)
    monkeypatch.setattr(remote, "connect", refuse)


@pytest.fixture
def offered_fingerprint():
    from tests.factories import fingerprint_for

    return fingerprint_for("the key the machine offers")


@pytest.fixture
def machine_offers(monkeypatch, offered_fingerprint):
    """The machine at any address answers as an SSH server offering ``offered_fingerprint``.

    Returns the list of (address, port) the console scanned.
    """
    from machines import remote

    scanned = []

    def scan(address, port):
        scanned.append((address, port))
        return offered_fingerprint

    monkeypatch.setattr(remote, "scan_host_key", scan)
    return scanned


@pytest.fixture
def enrol_calls(monkeypatch):
    """Record enrolment tasks instead of running them (they would SSH to the machine)."""
    from machines import tasks

    calls = []
    monkeypatch.setattr(tasks.machine_enrol, "delay", lambda job_id: calls.append(job_id))
    return calls


@pytest.fixture
def isolated_channel_layer(settings):
    """The real Redis channel layer of the settings, under a prefix of this test's own.

    Other runs may share the Redis; a prefix keeps their pushes out of our counts.
    """
    from channels.layers import channel_layers

    layers = {name: {**config, "CONFIG": {**config.get("CONFIG", {})}} for name, config in settings.CHANNEL_LAYERS.items()}
    layers["default"]["CONFIG"]["prefix"] = f"test-{uuid.uuid4().hex[:12]}"
    settings.CHANNEL_LAYERS = layers
    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


@pytest.fixture
def queued(monkeypatch):
    """The clusters' tasks enqueued after commit, recorded instead of run (they would reach the machines)."""
    from clusters import tasks

    calls = []
    monkeypatch.setattr(tasks.cluster_job, "delay", lambda job_id: calls.append(("cluster_job", job_id)))
    monkeypatch.setattr(tasks.cluster_check, "delay", lambda *args: calls.append(("cluster_check", *args)))
    monkeypatch.setattr(tasks.cluster_check, "apply_async",
                        lambda args, countdown=None, **kw: calls.append(("cluster_check later", *args, countdown)))
    monkeypatch.setattr(tasks.cluster_firewall_refresh, "delay", lambda *args: calls.append(("cluster_firewall_refresh", *args)))
    return calls
