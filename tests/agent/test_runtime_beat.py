"""The heartbeat's ``runtime`` section (``runtimebeat``): the process driver with a fake
``ray.json``, a real process that looks like a raylet and a real listening socket for the head's
port; the container drivers with a stand-in engine.  No Ray is needed."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from fadenstack_agent import beat, runtimebeat
from fadenstack_agent.protocol import RETRYABLE, AgentError


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A machine with the process driver configured and nothing started yet."""
    path = tmp_path / "store"
    (path / "runtime").mkdir(parents=True)
    config = tmp_path / "agent.json"
    config.write_text(json.dumps({"runtime_driver": "process",
                                  "process": {"ray": "/usr/bin/true", "python": "/usr/bin/python3"}}))
    monkeypatch.setenv("FADEN_AGENT_STORE", str(path))
    monkeypatch.setenv("FADEN_AGENT_CONFIG", str(config))
    return path


def started(store, driver="process", cluster="default"):
    (store / "runtime" / "state.json").write_text(json.dumps({"state": "started", "driver": driver, "cluster": cluster}))


def ray_record(store, **fields):
    (store / "runtime" / "ray.json").write_text(json.dumps(fields))


@pytest.fixture
def raylet(store):
    """A short-lived process whose command line is a raylet's for this store's Ray temp dir."""
    procs = []

    def start(temp=None):
        # One process that never forks: a shell's child, caught between its fork and its exec, would
        # still carry the raylet's argv after the shell is killed.
        proc = subprocess.Popen(["raylet", "-c", "import time; time.sleep(30)", "--temp_dir=%s" % (temp or store / "ray")],
                                executable=sys.executable)
        procs.append(proc)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:      # until /proc shows its argv (after the exec)
            with open("/proc/%d/cmdline" % proc.pid, "rb") as fh:
                if fh.read().startswith(b"raylet\0"):
                    break
            time.sleep(0.01)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


@pytest.fixture
def listening():
    """A real listening socket on 127.0.0.1: the head's GCS port, as far as a connect can tell."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)      # never accepted: each connect waits in the backlog
    yield sock
    sock.close()


def closed_port() -> int:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def report():
    return runtimebeat.RuntimeWatch().report()


def test_a_runtime_that_is_not_started_reports_nulls(store):
    assert report() == {"container": None,
                        "ray": {"role": None, "alive": None, "raylet": False, "head_port_open": None}}


def test_a_stopped_runtime_reports_nulls_even_with_a_ray_record_left(store):
    (store / "runtime" / "state.json").write_text(json.dumps({"state": "stopped", "driver": "process"}))
    ray_record(store, role="worker")
    assert report()["ray"] == {"role": None, "alive": None, "raylet": False, "head_port_open": None}


def test_a_worker_whose_raylet_runs_is_alive(store, raylet):
    started(store)
    ray_record(store, role="worker", address="127.0.0.1", gcs_address="127.0.0.1:6379")
    raylet()
    assert report() == {"container": None,
                        "ray": {"role": "worker", "alive": True, "raylet": True, "head_port_open": None}}


def test_a_worker_whose_raylet_is_gone_is_not_alive(store, raylet):
    started(store)
    ray_record(store, role="worker", address="127.0.0.1")
    proc = raylet()
    proc.kill()
    proc.wait()
    assert report()["ray"] == {"role": "worker", "alive": False, "raylet": False, "head_port_open": None}


def test_a_raylet_of_another_ray_temp_dir_does_not_count(store, raylet, tmp_path):
    started(store)
    ray_record(store, role="worker")
    raylet(temp=tmp_path / "elsewhere" / "ray")
    assert report()["ray"]["raylet"] is False


def test_the_head_is_alive_when_its_raylet_runs_and_its_port_answers(store, raylet, listening):
    started(store)
    ray_record(store, role="head", address="127.0.0.1", port=listening.getsockname()[1])
    raylet()
    assert report()["ray"] == {"role": "head", "alive": True, "raylet": True, "head_port_open": True}


def test_the_head_whose_port_is_closed_is_not_alive_though_its_raylet_runs(store, raylet):
    started(store)
    ray_record(store, role="head", address="127.0.0.1", port=closed_port())
    raylet()
    assert report()["ray"] == {"role": "head", "alive": False, "raylet": True, "head_port_open": False}


def test_ray_stopped_on_purpose_reports_no_role_and_alive_unknown(store):
    started(store)
    ray_record(store, role=None, sids=[])
    assert report()["ray"] == {"role": None, "alive": None, "raylet": False, "head_port_open": None}


def test_a_machine_config_the_driver_cannot_read_gives_nulls_and_says_why(store, tmp_path):
    started(store)
    (tmp_path / "agent.json").write_text(json.dumps({"runtime_driver": "process"}))
    watch = runtimebeat.RuntimeWatch()
    assert watch.report() == runtimebeat.not_started()
    assert "process" in watch.error


def test_every_beat_carries_the_runtime_section(store):
    payload = beat.beat_payload(runtimebeat.RuntimeWatch())
    assert set(payload) == {"agent_version", "hostname", "uptime_s", "boot_id", "runtime"}
    assert payload["runtime"] == runtimebeat.not_started()


def test_one_beat_s_runtime_section_is_cheap(store, raylet, listening):
    started(store)
    ray_record(store, role="head", address="127.0.0.1", port=listening.getsockname()[1])
    raylet()
    watch = runtimebeat.RuntimeWatch()
    began = time.monotonic()
    for _ in range(20):
        assert watch.report()["ray"]["alive"] is True
    assert (time.monotonic() - began) / 20 < 0.25


# ------------------------------------------------------------------ container drivers


class Engine:
    """Stands in for ``ContainerDriver.state``: what ``inspect`` would say, and how often it was asked."""

    def __init__(self, state):
        self.state, self.asked = state, 0

    def __call__(self, driver):
        self.asked += 1
        if isinstance(self.state, Exception):
            raise self.state
        return self.state


@pytest.fixture
def podman(store, tmp_path, monkeypatch):
    started(store, driver="podman", cluster="gpu-room")
    engine = Engine(None)
    monkeypatch.setattr("fadenstack_agent.engines.ContainerDriver.state", lambda driver: engine(driver))
    return engine


def running_as(pid: int) -> dict:
    return {"status": "running", "running": True, "pid": pid, "exit_code": None}


def test_a_container_the_engine_does_not_know_is_absent_and_its_ray_not_alive(store, podman):
    ray_record(store, role="worker")
    assert report() == {"container": "absent",
                        "ray": {"role": "worker", "alive": False, "raylet": False, "head_port_open": None}}


def test_an_exited_container_reads_exited(store, podman):
    podman.state = {"status": "exited", "running": False, "pid": None, "exit_code": 137}
    ray_record(store, role="worker")
    assert report()["container"] == "exited" and report()["ray"]["alive"] is False


def test_a_running_container_is_inspected_once_then_watched_in_proc_until_the_nth_beat(store, podman):
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        podman.state = running_as(sleeper.pid)
        watch = runtimebeat.RuntimeWatch()
        containers = [watch.report()["container"] for _ in range(runtimebeat.INSPECT_EVERY)]
        assert containers == ["running"] * runtimebeat.INSPECT_EVERY
        assert podman.asked == 1
        watch.report()
        assert podman.asked == 2

        sleeper.kill()
        sleeper.wait()
        podman.state = {"status": "exited", "running": False, "pid": None, "exit_code": 137}
        assert watch.report()["container"] == "exited"    # the process went: the engine is asked at once
        assert podman.asked == 3
    finally:
        sleeper.kill()
        sleeper.wait()


def test_an_engine_that_does_not_answer_leaves_the_container_and_ray_unknown(store, podman):
    podman.state = AgentError(RETRYABLE, "podman did not answer within 60 s")
    ray_record(store, role="head", address="127.0.0.1", port=1)
    watch = runtimebeat.RuntimeWatch()
    assert watch.report() == {"container": None,
                              "ray": {"role": "head", "alive": None, "raylet": False, "head_port_open": None}}
    assert "did not answer" in watch.error


def test_port_open_is_false_for_nonsense_rather_than_an_error():
    assert runtimebeat.port_open(None, None) is False
    assert runtimebeat.port_open("127.0.0.1", "x") is False
    assert os.path.exists("/proc/self/stat")
