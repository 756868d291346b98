"""Agent tests: no Django; the agent package is imported from ``agent/``."""

import glob
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT_DIR = os.path.join(REPO, "agent")
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")

# Keep agent/ free of __pycache__: the console zips that directory as it is.
sys.dont_write_bytecode = True
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
if AGENT_DIR not in sys.path:
    sys.path.insert(0, AGENT_DIR)


@pytest.fixture(autouse=True)
def _secrets_apart(tmp_path_factory, monkeypatch):
    """The clusters' secrets directories (``secretsdir``) in a directory of the test's, never /etc."""
    monkeypatch.setenv("FADEN_AGENT_SECRETS", str(tmp_path_factory.mktemp("secrets") / "clusters"))


@pytest.fixture
def machine_python() -> str:
    """The interpreter the agent meets on machines (/usr/bin/python3), else ours."""
    return "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable


@pytest.fixture
def oldest_python():
    """A Python 3.9 if this host has one (pyenv), for the 3.9+ promise."""
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python3")))
    found += [p for p in (shutil.which("python3.9"),) if p]
    return found[0] if found else None


@pytest.fixture
def agent_dir():
    return AGENT_DIR


@pytest.fixture
def fixtures_dir():
    return FIXTURES


@pytest.fixture
def small_fs():
    """Mount a tmpfs of the given MiB (root only); skipped otherwise."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    mounted = []

    def make(mib):
        path = tempfile.mkdtemp(prefix="faden-small-")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=%dm" % mib, "tmpfs", path],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        if proc.returncode:
            os.rmdir(path)
            pytest.skip("cannot mount a tmpfs here: %s" % proc.stdout.decode().strip())
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", path])
        os.rmdir(path)


@pytest.fixture(autouse=True)
def cluster_secrets_elsewhere(tmp_path, monkeypatch):
    """The clusters' secrets directories (/etc/fadenstack/clusters as root) in the test's own directory."""
    monkeypatch.setenv("FADEN_AGENT_SECRETS", str(tmp_path / "agent-secrets"))
