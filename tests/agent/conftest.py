"""Agent tests: no Django; the agent package is imported from ``agent/``."""

import glob
import os
import shutil
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT_DIR = os.path.join(REPO, "agent")
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")

# Keep agent/ free of __pycache__: the console zips that directory as it is.
sys.dont_write_bytecode = True
os.environ["PYTHONDONTWRITEBYTECODE"] = "1"
if AGENT_DIR not in sys.path:
    sys.path.insert(0, AGENT_DIR)


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
