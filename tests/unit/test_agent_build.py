"""The agent's zipapp: built reproducibly from agent/, and it runs on a machine's own python3."""
import json
import os
import subprocess
from pathlib import Path

import pytest
from django.conf import settings

from machines import agent

MACHINE_PYTHON = "/usr/bin/python3"

pytestmark = pytest.mark.skipif(
    not (agent.AGENT_SOURCE / agent.PACKAGE / "__main__.py").exists(),
    reason="the agent (agent/fadenstack_agent/__main__.py) is not written yet",
)


@pytest.fixture
def fresh_build(settings, tmp_path):
    """agent_build() from scratch, into a data directory of this test's own."""
    settings.DATA_DIR = tmp_path
    agent.agent_build.cache_clear()
    yield
    agent.agent_build.cache_clear()


def build_from_scratch():
    agent.agent_build.cache_clear()
    build = agent.agent_build()
    content = build.path.read_bytes()
    build.path.unlink()
    return build, content


def test_agent_build_is_reproducible(fresh_build):
    first, first_bytes = build_from_scratch()
    second, second_bytes = build_from_scratch()

    assert first.sha256 == second.sha256
    assert first_bytes == second_bytes
    assert first.path == second.path


def test_agent_build_is_named_after_its_version_and_digest(fresh_build):
    build = agent.agent_build()
    version = (agent.AGENT_SOURCE / agent.PACKAGE / "VERSION").read_text().strip()

    assert build.version == version
    assert build.filename == f"fadenstack-agent-{version}.pyz"
    assert build.path.parent == Path(settings.DATA_DIR) / "agent-builds"
    assert build.path.name == f"fadenstack-agent-{version}-{build.sha256[:12]}.pyz"
    assert build.path.read_bytes().startswith(b"#!/usr/bin/env python3\n")


def test_agent_build_leaves_compiled_files_out(fresh_build):
    import zipfile

    names = zipfile.ZipFile(agent.agent_build().path).namelist()
    assert "__main__.py" in names
    assert "fadenstack_agent/VERSION" in names
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]


@pytest.mark.skipif(not os.path.exists(MACHINE_PYTHON), reason=f"no {MACHINE_PYTHON} on this host")
def test_the_zipapp_runs_version_with_the_machines_python_and_prints_the_version_file(fresh_build, tmp_path):
    build = agent.agent_build()
    version = (agent.AGENT_SOURCE / agent.PACKAGE / "VERSION").read_text().strip()

    # Run from elsewhere, with nothing of ours on the path: as on a machine.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LC_ALL": "C"}
    done = subprocess.run(
        [MACHINE_PYTHON, str(build.path), "version"], capture_output=True, text=True, timeout=30, cwd=tmp_path, env=env
    )

    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"event": "result", "version": version}


def _run(python_args: list, cwd, env_extra=None) -> dict:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "LC_ALL": "C", **(env_extra or {})}
    done = subprocess.run([MACHINE_PYTHON, *python_args], capture_output=True, text=True, timeout=30, cwd=cwd, env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists(MACHINE_PYTHON), reason=f"no {MACHINE_PYTHON} on this host")
def test_the_zipapp_runs_from_a_copy_unpacked_beside_it_with_its_bytecode_and_a_replaced_build_gets_its_own(
        fresh_build, tmp_path):
    installed = tmp_path / "agent" / "fadenstack-agent-9.pyz"
    installed.parent.mkdir()
    installed.write_bytes(agent.agent_build().path.read_bytes())

    # PYTHONDONTWRITEBYTECODE (set in some shells) does not stop the copy's bytecode: it is what the copy is for.
    _run([str(installed), "version"], tmp_path, {"PYTHONDONTWRITEBYTECODE": "1"})
    copies = list((installed.parent / ".unpacked").iterdir())
    assert [c.name for c in copies] == [f"{installed.name}-{agent.agent_build().sha256[:16]}"]
    assert list((copies[0] / agent.PACKAGE / "__pycache__").glob("__main__.*.pyc"))

    # A new build under the same name: its own copy, and the old one goes.
    import zipfile
    with zipfile.ZipFile(installed, "a") as archive:  # the same zip with a comment: other bytes, another digest
        archive.comment = b"rebuilt"
    assert _run([str(installed), "version"], tmp_path)["event"] == "result"
    assert [c.name for c in (installed.parent / ".unpacked").iterdir()] != [copies[0].name]
    assert len(list((installed.parent / ".unpacked").iterdir())) == 1


@pytest.mark.skipif(not os.path.exists(MACHINE_PYTHON), reason=f"no {MACHINE_PYTHON} on this host")
def test_the_zipapp_runs_from_the_zip_where_nothing_can_be_unpacked(fresh_build, tmp_path):
    installed = tmp_path / "agent" / "fadenstack-agent-9.pyz"
    installed.parent.mkdir()
    installed.write_bytes(agent.agent_build().path.read_bytes())
    (installed.parent / ".unpacked").write_text("a file where the directory would go: it cannot be made")

    assert _run([str(installed), "version"], tmp_path)["event"] == "result"
    assert (installed.parent / ".unpacked").is_file()


def test_two_processes_building_at_once_each_finish_with_the_same_build(fresh_build, monkeypatch):
    # Enrolments in several worker processes build at once on a fresh console: another writer finishes
    # while this one is between writing its file and renaming it (it once renamed this one's file away).
    import threading

    real_replace, others = Path.replace, []

    def replace_after_another_writer(self, target):
        if not others:
            others.append(threading.Thread(target=agent.agent_build.__wrapped__))
            others[0].start()
            others[0].join()
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", replace_after_another_writer)
    build = agent.agent_build.__wrapped__()
    assert others and build.path.exists()
    assert sorted(p.name for p in build.path.parent.iterdir()) == [build.path.name]  # no writer's file left
