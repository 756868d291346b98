"""The lab as fixtures (a plugin of tests/conftest.py): built once for the whole test run with the
console's key on its machines, healed between modules, taken down at the end.

- ``lab``: the lab, up, with every fault of an earlier module undone (power, links, sshd, ports, disks);
  a module that injects faults undoes its own as well, but a failed test may leave one behind.
- ``fresh_lab``: for the modules that test the lab itself (its `up`, its `down`, a machine's files as
  `up` made them): a lab this run's `up` has just built: taken down and put up again, unless no module
  has used it yet (tests/lab/test_lab.py runs first, tests/conftest.py LAB_FIRST, so the run's first
  `up` is its own); the next module finds it up again.
- machines run the `process` runtime unless a module switches them to Podman (`lab.runtime`) and back;
- ``lab_machine(name)``: a machine's status now (its address, its host key as it is now).
- ``console_url``: the in-process live server as the machines reach it (for heartbeats).
"""
from concurrent.futures import ThreadPoolExecutor
import os
import shutil
import tempfile
import time

import pytest

from django.core.exceptions import ImproperlyConfigured

from lab.harness import AnotherLabIsUp, Lab, make_key
from tests.harness import LAB_CONSOLE_ADDRESS, console_lab

# Machines post heartbeats to the live server at the lab's bridge address, so it listens on every address.
os.environ.setdefault("DJANGO_LIVE_TEST_SERVER_ADDRESS", "0.0.0.0")


def uses_lab(item) -> bool:
    return item.get_closest_marker("lab") is not None or "lab_session" in getattr(item, "fixturenames", ())


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """One lab per host: every test that uses it runs in one xdist worker (group ``lab``), in order."""
    for item in items:
        if uses_lab(item):
            item.add_marker(pytest.mark.xdist_group("lab"))


def pytest_configure(config):
    """The lab's machines keep beating after a test ends, to the agents' listener in a process of its own: a
    transactional test's flush (one TRUNCATE of every table) can meet a heartbeat's transaction, and
    PostgreSQL then ends one of the two as a deadlock (seen once, ending the TRUNCATE). The flush tries again."""
    from django.core.management.base import CommandError
    from django.core.management.commands import flush

    handle = flush.Command.handle
    if getattr(handle, "retries_a_deadlock", False):
        return

    def handle_again(self, **options):
        for attempt in range(3):
            try:
                return handle(self, **options)
            except CommandError as exc:
                if attempt == 2 or "deadlock detected" not in str(exc.__cause__ or ""):
                    raise
                time.sleep(0.2)

    handle_again.retries_a_deadlock = True
    flush.Command.handle = handle_again


def lab_missing() -> str | None:
    """Why this host cannot hold the lab, or None."""
    from lab import util as lab_util

    if os.geteuid() != 0:
        return "the lab needs root (network namespaces)"
    if shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"):
        return "the lab needs OpenSSH's sshd (apt-get install openssh-server)"
    if not (shutil.which("ssh") and shutil.which("ssh-keygen") and shutil.which("ssh-keyscan")):
        return "the lab tests need the OpenSSH client (ssh, ssh-keygen, ssh-keyscan)"
    return lab_util.missing_host_support()


@pytest.fixture(scope="session")
def lab_session():
    """The lab of this test run (lab-a .. lab-e), put up when a module first asks for it."""
    if reason := lab_missing():
        pytest.skip(reason)
    state_dir = tempfile.mkdtemp(prefix="fadenstack-lab-")
    try:
        lab = console_lab(state_dir)
    except ImproperlyConfigured:  # -p no:django (tests/lab, tests/agent): a key of the lab's own
        lab = Lab(state_dir, key=make_key(f"{state_dir}.key/id_ed25519"))
    os.environ["FADEN_LAB_DIR"] = str(lab.state_dir)  # `faden lab ...` by hand, and the console's processes
    try:
        yield lab
    finally:
        lab.run("down", check=False)
        os.environ.pop("FADEN_LAB_DIR", None)


def _up(lab: Lab) -> Lab:
    """The lab up, its machines on the `process` runtime: the fast path for the tests that do not test
    the runtime itself (those that do switch their machines to Podman, `runtime_machines`)."""
    try:
        lab.up()
    except AnotherLabIsUp as refused:
        pytest.fail(f"{refused} (one lab per host; is someone else's test run or bench using it?)")
    lab.runtime("process", *(m["name"] for m in lab.status()["machines"]))
    return lab


# The agent's firewall tables (one per cluster, `inet fadenstack_<cluster>`) that a module's clusters left on
# the machines: its records are deleted with the test database, not by Delete's "Open the firewall", and a
# table of a cluster of other machines would drop the next module's file servers and Ray between them.
CLEAR_FIREWALLS = ("nft list tables 2>/dev/null | awk '$3 ~ /^fadenstack_/ {print $2, $3}' | "
                   "while read -r family table; do nft delete table \"$family\" \"$table\"; done; true")


def clear_firewalls(lab: Lab) -> None:
    addresses = [machine["address"] for machine in lab.machines().values() if machine["powered"]]
    with ThreadPoolExecutor(max(1, len(addresses))) as pool:
        list(pool.map(lambda address: lab.ssh(address, CLEAR_FIREWALLS, timeout=15), addresses))


@pytest.fixture(scope="module")
def lab(lab_session) -> Lab:
    _up(lab_session)
    lab_session.heal()
    clear_firewalls(lab_session)
    yield lab_session
    lab_session.heal()
    clear_firewalls(lab_session)


@pytest.fixture(scope="module")
def fresh_lab(lab_session) -> Lab:
    if lab_session.is_up():
        lab_session.down()
    yield _up(lab_session)
    lab_session.heal()


@pytest.fixture
def lab_machine(lab):
    return lab.machine


@pytest.fixture(scope="session")
def agents_listener(django_db_setup):
    """The agents' TLS listener as faden serve runs it, on the test database, once for the run: its port."""
    from tests.processes import agents_listener as listener

    with listener() as port:
        yield port


@pytest.fixture
def console_url(live_server, settings, agents_listener):
    """Point the machines at the live server, as the lab's machines see it; 0.10.0 agents get the agents'
    TLS listener (heartbeats, the first copies) with its pin."""
    port = live_server.url.rsplit(":", 1)[1]
    settings.FADEN_CONSOLE_URL = f"http://{LAB_CONSOLE_ADDRESS}:{port}"
    settings.FADEN_AGENT_TLS_URL = f"https://{LAB_CONSOLE_ADDRESS}:{agents_listener}"
    return settings.FADEN_CONSOLE_URL
