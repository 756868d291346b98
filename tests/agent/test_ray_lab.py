"""Ray for real in the lab, driven through the agent over SSH: a head on
lab-a, lab-b joining it, Ray's own status, a taken port on lab-c, stopping.

Needs root: it uses the test run's lab (tests/lab_fixtures.py), and at the end
powers lab-a, lab-b and lab-c off (Ray left running must go with its machine,
as it does at `faden lab down`: both kill every process of the namespace), on
again, and removes what it put on them. One lab per host: run it as

    flock /tmp/fadenstack-lab-user.lock .venv/bin/python -m pytest tests/agent/test_ray_lab.py -q

The timings (head start, join, status) and the memory of each Ray node are
printed (``-s`` shows them) and kept in ``TIMINGS``.
"""

import json
import os
import shutil
import subprocess
import sys
import time
import zipapp
from concurrent.futures import ThreadPoolExecutor

import pytest

from lab.harness import SSH_OPTIONS

pytestmark = pytest.mark.lab

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT_DIR = os.path.join(REPO, "agent")
AGENT = "/tmp/fadenstack-agent.pyz"        # inside each machine (its own /tmp)
DIGEST = "5e" * 32
MGMT = {"lab-a": "198.18.0.11", "lab-b": "198.18.0.12", "lab-c": "198.18.0.13"}
FABRIC = {"lab-a": "198.18.1.11", "lab-b": "198.18.1.12", "lab-c": "198.18.1.13"}
HEAD = FABRIC["lab-a"] + ":6379"
TIMINGS = {}


class RayLab:
    """The lab, its machines by name, and the agent on them (run from /tmp, outside the console)."""

    def __init__(self, lab):
        self.lab = lab
        self.leftover = {}

    def run(self, *args, check=True):
        return self.lab.run(*args, check=check, timeout=120)

    def ssh(self, machine, command, timeout=150):
        return self.lab.ssh(MGMT[machine], command, timeout=timeout)

    def agent(self, machine, *args):
        """Run the agent on a machine; (final event, all events, seconds)."""
        started = time.monotonic()
        result = self.ssh(machine, "python3 %s %s" % (AGENT, " ".join("'%s'" % a for a in args)))
        seconds = time.monotonic() - started
        events = []
        for line in result.stdout.splitlines():
            try:
                events.append(json.loads(line))
            except ValueError:
                pass
        assert events, "no JSON from the agent on %s (exit %s): %s %s" % (
            machine, result.returncode, result.stdout[-2000:], result.stderr[-2000:])
        return events[-1], events, seconds


def build_zip(directory):
    src = os.path.join(directory, "agent-src")
    shutil.copytree(AGENT_DIR, src, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    target = os.path.join(directory, "fadenstack-agent.pyz")
    zipapp.create_archive(source=src, target=target, main="fadenstack_agent.__main__:main")
    return target


def rss_mib(pids):
    """Resident memory of the given pids (host view: the lab shares one process table)."""
    total = 0
    for pid in pids:
        try:
            with open("/proc/%d/status" % pid) as fh:
                total += next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))
        except (OSError, StopIteration, ValueError):
            pass
    return round(total / 1024.0)


def alive(pids):
    """Those pids still alive (zombies are dead)."""
    found = []
    for pid in pids:
        try:
            with open("/proc/%d/stat" % pid) as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    found.append(pid)
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def lab(lab, tmp_path_factory):
    if not os.access(os.path.join(sys.prefix, "bin", "ray"), os.X_OK):
        pytest.skip("Ray is not installed in %s (the `lab` extra)" % sys.prefix)
    base = str(tmp_path_factory.mktemp("raylab"))
    running = RayLab(lab)
    try:
        pyz = build_zip(base)
        loaded = json.dumps({"digest": DIGEST, "manifest": {"name": "faden-runtime", "version": "2.0.0",
                                                             "arch": "x86_64", "accelerator_vendor": "nvidia"}})
        setup = ("mkdir -p /var/lib/fadenstack/runtime && printf '%%s' '%s' > /var/lib/fadenstack/runtime/"
                 "loaded.json && python3 %s runtime start --digest %s" % (loaded, AGENT, DIGEST))

        def install(machine):
            copy = subprocess.run(["scp", "-q", "-i", str(lab.key), *SSH_OPTIONS,
                                   pyz, "root@%s:%s" % (MGMT[machine], AGENT)],
                                  capture_output=True, text=True, timeout=60)
            assert copy.returncode == 0, copy.stderr
            return running.ssh(machine, setup)

        with ThreadPoolExecutor(3) as pool:
            for result in pool.map(install, ["lab-a", "lab-b", "lab-c"]):
                assert '"event":"result"' in result.stdout, result.stdout + result.stderr
        yield running
    finally:
        started = time.monotonic()
        for machine in MGMT:
            running.run("fault", machine, "power-off", check=False)
        TIMINGS["power_off"] = round(time.monotonic() - started, 1)
        print("\nRay in the lab: %s" % json.dumps(TIMINGS, sort_keys=True))
        # Ray that still ran at power-off (a node whose head was stopped) went with its machine.
        assert not alive(running.leftover.get("pids", [])), "Ray processes survived their machine's power-off"
        lab.heal()
        for machine in MGMT:  # the next module finds the machines as `up` left them
            running.ssh(machine, "rm -rf /var/lib/fadenstack/runtime %s /tmp/.unpacked" % AGENT, timeout=30)


@pytest.fixture(scope="module")
def cluster(lab):
    final, events, seconds = lab.agent("lab-a", "ray", "start-head", "--address", FABRIC["lab-a"],
                                       "--port", "6379", "--num-gpus", "8", "--resources", '{"h100": 8}')
    assert final["event"] == "result", final
    TIMINGS["head_start_ssh"] = round(seconds, 1)
    TIMINGS["head_start"] = final["timings"]
    final, events, seconds = lab.agent("lab-b", "ray", "join", "--head", HEAD, "--address", FABRIC["lab-b"],
                                       "--num-gpus", "8", "--resources", '{"h100": 8}')
    assert final["event"] == "result", final
    TIMINGS["join_ssh"] = round(seconds, 1)
    TIMINGS["join"] = final["timings"]
    nodes = {}
    for machine in ("lab-a", "lab-b"):
        status, _, _ = lab.agent(machine, "runtime", "status")
        nodes[machine] = status["ray"]
        TIMINGS["rss_mib_" + machine] = rss_mib(status["ray"]["pids"])
    return nodes


def test_head_and_worker_run_with_their_roles(lab, cluster):
    assert cluster["lab-a"]["running"] and cluster["lab-a"]["role"] == "head"
    assert cluster["lab-a"]["gcs_address"] == HEAD and cluster["lab-a"]["address"] == FABRIC["lab-a"]
    assert cluster["lab-b"]["role"] == "worker" and cluster["lab-b"]["gcs_address"] == HEAD
    assert cluster["lab-b"]["address"] == FABRIC["lab-b"]


def test_status_from_ray_lists_two_alive_nodes_and_sixteen_gpus(lab, cluster):
    final, _, seconds = lab.agent("lab-a", "ray", "status", "--head", HEAD)
    TIMINGS["status_ssh"] = round(seconds, 1)
    TIMINGS["status"] = final["seconds"]
    assert final["event"] == "result", final
    assert (final["alive_nodes"], final["gpus"]) == (2, 16)
    alive_nodes = [n for n in final["nodes"] if n["alive"]]
    assert sorted(n["address"] for n in alive_nodes) == [FABRIC["lab-a"], FABRIC["lab-b"]]
    assert {n["node_id"] for n in alive_nodes} == {cluster["lab-a"]["node_id"], cluster["lab-b"]["node_id"]}


def test_starting_again_is_a_no_op_that_says_already_running(lab, cluster):
    final, _, _ = lab.agent("lab-a", "ray", "start-head", "--address", FABRIC["lab-a"], "--port", "6379",
                            "--num-gpus", "8")
    assert final["event"] == "result" and final["already_running"] is True
    assert final["node_id"] == cluster["lab-a"]["node_id"]
    final, _, _ = lab.agent("lab-b", "ray", "join", "--head", HEAD, "--address", FABRIC["lab-b"],
                            "--num-gpus", "8")
    assert final["event"] == "result" and final["already_running"] is True
    assert final["node_id"] == cluster["lab-b"]["node_id"]


def test_a_taken_port_is_address_in_use_with_the_systems_words(lab, cluster):
    lab.run("fault", "lab-c", "port-taken", "6379")
    final, _, seconds = lab.agent("lab-c", "ray", "start-head", "--address", FABRIC["lab-c"], "--port", "6379",
                                  "--num-gpus", "4")
    assert final["event"] == "error" and final["kind"] == "address_in_use", final
    assert "Address already in use" in final["message"]
    assert "port 6379 on 198.18.1.13" in final["message"]
    assert seconds < 10
    status, _, _ = lab.agent("lab-c", "runtime", "status")
    assert status["ray"]["running"] is False and status["ray"]["pids"] == []


def test_ray_stop_on_the_worker_tells_the_head_at_once(lab, cluster):
    final, _, seconds = lab.agent("lab-b", "ray", "stop")
    TIMINGS["stop_worker_ssh"] = round(seconds, 1)
    assert final["event"] == "result" and final["stopped"] is True
    assert set(cluster["lab-b"]["pids"]) <= set(final["pids"]) and not alive(cluster["lab-b"]["pids"])
    deadline = time.monotonic() + 10
    while True:     # the raylet went first and unregistered: no health-check timeout to wait for
        status, _, _ = lab.agent("lab-a", "ray", "status", "--head", HEAD)
        if status.get("alive_nodes") == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert (status["alive_nodes"], status["gpus"]) == (1, 8)
    final, _, _ = lab.agent("lab-b", "ray", "stop")
    assert final["event"] == "result" and final["stopped"] is False


def test_ray_stop_stops_the_head_and_runtime_stop_follows(lab, cluster):
    final, _, seconds = lab.agent("lab-a", "ray", "stop")
    TIMINGS["stop_head_ssh"] = round(seconds, 1)
    assert final["event"] == "result" and final["stopped"] is True
    assert set(cluster["lab-a"]["pids"]) <= set(final["pids"]) and not alive(cluster["lab-a"]["pids"])
    status, _, _ = lab.agent("lab-a", "runtime", "status")
    assert status["ray"] == {"running": False, "role": None, "address": None, "gcs_address": None,
                             "node_id": None, "pids": []}
    final, _, _ = lab.agent("lab-a", "runtime", "stop")
    assert final["event"] == "result" and final["was_started"] is True and final["ray"]["stopped"] is False
    final, _, _ = lab.agent("lab-a", "ray", "start-head", "--address", FABRIC["lab-a"], "--num-gpus", "8")
    assert final["event"] == "error" and final["kind"] == "not_retryable"
    assert "runtime start" in final["message"]


def test_power_off_ends_the_machines_ray_and_only_that_machines(lab, cluster):
    """A head on lab-c (its port freed), lab-b joined to it; power-off lab-c
    ends lab-c's Ray; lab-b's still runs (the fixture powers lab-b off at the
    end and checks it goes)."""
    lab.run("fault", "lab-c", "port-free", "6379")
    head = FABRIC["lab-c"] + ":6379"
    final, _, _ = lab.agent("lab-c", "ray", "start-head", "--address", FABRIC["lab-c"], "--num-gpus", "4")
    assert final["event"] == "result" and final["already_running"] is False, final
    final, _, _ = lab.agent("lab-b", "ray", "join", "--head", head, "--address", FABRIC["lab-b"],
                            "--num-gpus", "8")
    assert final["event"] == "result" and final["already_running"] is False, final
    status, _, _ = lab.agent("lab-c", "ray", "status", "--head", head)
    assert (status["alive_nodes"], status["gpus"]) == (2, 12)
    pids = {}
    for machine in ("lab-b", "lab-c"):
        pids[machine] = lab.agent(machine, "runtime", "status")[0]["ray"]["pids"]
        assert pids[machine] and alive(pids[machine])
    TIMINGS["rss_mib_lab-c_head_of_4"] = rss_mib(pids["lab-c"])
    lab.run("fault", "lab-c", "power-off")
    assert not alive(pids["lab-c"])
    assert alive(pids["lab-b"])
    lab.leftover["pids"] = pids["lab-b"]
