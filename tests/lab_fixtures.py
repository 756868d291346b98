"""The lab as fixtures: up once per test package that imports them, with the console's key on its machines."""
import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

# Machines post heartbeats to the live server at the lab's bridge address, so it listens on every address.
os.environ.setdefault("DJANGO_LIVE_TEST_SERVER_ADDRESS", "0.0.0.0")

LAB_CONSOLE_ADDRESS = "198.18.0.1"


def _lab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lab", *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="package")
def lab_dir():
    if os.geteuid() != 0:
        pytest.skip("the lab needs root (network namespaces)")
    if shutil.which("sshd") is None and not os.path.exists("/usr/sbin/sshd"):
        pytest.skip("the lab needs OpenSSH's sshd (apt-get install openssh-server)")
    directory = tempfile.mkdtemp(prefix="fadenstack-lab-")
    os.environ["FADEN_LAB_DIR"] = directory
    yield directory
    os.environ.pop("FADEN_LAB_DIR", None)


@pytest.fixture(scope="package")
def lab(lab_dir, django_db_blocker):
    """The default lab: lab-a .. lab-e. Yields `faden lab status --json`."""
    from machines.remote import console_key_path, console_public_key

    with django_db_blocker.unblock():
        console_public_key()
    up = _lab("up", "--authorized-key", str(console_key_path().with_suffix(".pub")))
    assert up.returncode == 0, up.stderr
    try:
        yield lab_status()
    finally:
        down = _lab("down")
        assert down.returncode == 0, down.stderr


def lab_status() -> dict:
    status = _lab("status", "--json")
    assert status.returncode == 0, status.stderr
    return json.loads(status.stdout)


def lab_fault(machine: str, *kind: str) -> None:
    result = _lab("fault", machine, *kind)
    assert result.returncode == 0, result.stderr


@pytest.fixture
def lab_machine(lab):
    machines = {m["name"]: m for m in lab["machines"]}
    return lambda name: {**machines[name], **{m["name"]: m for m in lab_status()["machines"]}[name]}


@pytest.fixture
def console_url(live_server, settings):
    """Point the machines' heartbeats at the live server, as the lab's machines see it."""
    port = live_server.url.rsplit(":", 1)[1]
    settings.FADEN_CONSOLE_URL = f"http://{LAB_CONSOLE_ADDRESS}:{port}"
    return settings.FADEN_CONSOLE_URL
