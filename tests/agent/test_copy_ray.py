"""A copy over several machines runs a Ray of its own (``fadenstack_agent.copyray``): the spec of its
nodes refused in words, their ``ray start`` command lines, and the real agent starting a real Ray head
and a node joining it on 127.0.0.1 with only the copy's GPUs visible, then the lab's engine spanning
both (pipeline parallel through that Ray), and stopping everything."""

import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time

import pytest

from fadenstack_agent import copies, copyproc, copyray, ports
from fadenstack_agent.protocol import AgentError
from tests.agent.test_copies import ENGINE, agent, argv_for, free_port, tiny_model  # noqa: F401 (a fixture)
from tests.agent.imagehelpers import Machine

HEAD = {"copy": "d7-c3-ray", "cluster": "gpu-room", "address": "198.18.1.11", "ray": {"head": None, "gpus": 2},
        "env": {"CUDA_VISIBLE_DEVICES": "2,3"}}


def test_a_ray_node_spec_passes_with_the_head_address_normalised():
    assert copies.check_spec(dict(HEAD)) == HEAD
    joining = dict(HEAD, ray={"head": " 198.18.1.11:41234", "gpus": 2})
    assert copies.check_spec(joining)["ray"] == {"head": "198.18.1.11:41234", "gpus": 2}


@pytest.mark.parametrize("change, words", [
    ({"argv": ["vllm", "serve"]}, "a copy's Ray node has ray, not argv or port"),
    ({"port": 8100}, "a copy's Ray node has ray, not argv or port"),
    ({"copy": "d7-c3"}, "named after the copy with '-ray' at the end"),
    ({"ray": {"head": None, "gpus": 2, "port": 1}}, "ray must be an object"),
    ({"ray": {"head": None, "gpus": 3}}, "ray.gpus is 3 but the spec's visible devices name 2 GPUs"),
    ({"ray": {"head": None, "gpus": -1}}, "ray.gpus must be a whole number from 0 to 64"),
    ({"ray": {"head": "lab-a:6379", "gpus": 2}}, "ray.head must be an IP address"),
    ({"ray": {"head": "198.18.1.11", "gpus": 2}}, "ray.head must be ADDR:PORT"),
    ({"env": {"LD_PRELOAD": "/x.so"}}, "the variable \"LD_PRELOAD\" is not one a copy may be given"),
])
def test_each_refusal_of_a_ray_node_spec_says_why(change, words):
    with pytest.raises(AgentError) as refused:
        copies.check_spec(dict(HEAD, **change))
    assert refused.value.kind == "bad_input" and words in refused.value.message


@pytest.fixture
def short_dir():
    """A directory with a short path: Ray's socket paths under a store must fit AF_UNIX's 107 bytes."""
    path = tempfile.mkdtemp(prefix="fc")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_node_s_command_picks_the_ports_the_cluster_s_own_ray_would_hold_and_a_temp_dir_of_its_own(short_dir):
    temp = copyray.temp_dir(short_dir, "d7-c3-ray")
    assert temp.startswith(os.path.join(short_dir, "cr")) and temp != copyray.temp_dir(short_dir, "d7-c4-ray")
    with pytest.raises(AgentError, match="is too long"):
        copyray.temp_dir(short_dir + "/" + "x" * 60, "d7-c3-ray")
    env = {}
    head = copyray.node_argv("ray", {"head": None, "gpus": 2}, "127.0.0.1", temp, 41234, ["--num-cpus=1"], "d7-c3-ray", env)
    assert env["RAY_enable_metrics_collection"] == "0"
    metrics = {int(env["DASHBOARD_METRIC_PORT"]), int(env["AUTOSCALER_METRIC_PORT"])}
    assert head[:6] == ["ray", "start", "--block", "--head", "--port=41234", "--include-dashboard=false"]
    given = {}
    for flag in ("--ray-client-server-port=", "--dashboard-agent-listen-port=", "--dashboard-port=",
                 "--node-manager-port=", "--object-manager-port=", "--dashboard-agent-grpc-port=",
                 "--metrics-export-port=", "--runtime-env-agent-port=", "--min-worker-port=", "--max-worker-port="):
        (word,) = [word for word in head if word.startswith(flag)]
        given[flag] = int(word.split("=")[1])
        # Pinned in the copies' range, away from the cluster's own Ray (which holds Ray's defaults).
        assert ports.COPY_RAY[0] <= given[flag] <= ports.COPY_RAY[1]
    singles = [v for k, v in given.items() if "worker-port" not in k] + sorted(metrics)
    assert len(set(singles)) == len(singles) and 41234 not in singles
    assert given["--max-worker-port="] - given["--min-worker-port="] == copyray.WORKER_PORTS - 1
    assert not set(singles) & set(range(given["--min-worker-port="], given["--max-worker-port="] + 1))
    assert "--dashboard-host=127.0.0.1" in head
    assert "--num-gpus=2" in head and "--temp-dir=%s" % temp in head and "--num-cpus=1" in head
    node = copyray.node_argv("ray", {"head": "127.0.0.1:41234", "gpus": 1}, "127.0.0.1", temp, None, [])
    assert node[:4] == ["ray", "start", "--block", "--address=127.0.0.1:41234"] and "--head" not in node


# ------------------------------------------------------------------ for real, on 127.0.0.1


@pytest.fixture
def machines(short_dir):
    """Two machines on the process driver sharing 127.0.0.1 (Ray allows two nodes on one address), Ray from
    this Python's environment, the lab's engine as their vllm."""
    ray = os.path.join(os.path.dirname(sys.executable), "ray")
    made, config = [], {"runtime_driver": "process",
                        "engine_env": {"FADEN_LAB_ENGINE_PACE": "2000", "FADEN_LAB_RAY_PYTHON": sys.executable},
                        "process": {"ray": ray, "python": sys.executable, "vllm": ENGINE, "num_cpus": 1}}
    for name in ("gpu-a", "gpu-b"):
        machine = Machine(short_dir, name)
        os.makedirs(os.path.join(machine.store, "runtime"))
        with open(machine.env["FADEN_AGENT_CONFIG"], "w") as fh:
            json.dump(config, fh)
        with open(os.path.join(machine.store, "runtime", "state.json"), "w") as fh:
            json.dump({"state": "started", "driver": "process", "cluster": "gpu-room"}, fh)
        made.append(machine)
    yield made
    for machine in reversed(made):
        for record in copyproc.read_records(machine.store):
            copyproc.stop_copy(record, config, 10.0)


@pytest.mark.skipif(not os.path.exists(os.path.join(os.path.dirname(sys.executable), "ray")), reason="Ray is not installed here")
def test_a_copy_spans_two_machines_through_a_ray_of_its_own_with_only_its_gpus(machines, tiny_model):  # noqa: F811
    first, second = machines
    code, head = agent(first, "copy", "start", stdin=dict(HEAD, address="127.0.0.1"))
    assert code == 0, head
    gcs = "127.0.0.1:%d" % head["port"]
    code, node = agent(second, "copy", "start", stdin=dict(HEAD, address="127.0.0.1", ray={"head": gcs, "gpus": 1},
                                                           env={"CUDA_VISIBLE_DEVICES": "5"}))
    assert code == 0, node
    port = free_port()
    spec = {"copy": "d7-c3", "cluster": "gpu-room", "address": "127.0.0.1", "port": port,
            "argv": argv_for(tiny_model, port, "--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray",
                             tp=1),
            "env": {"CUDA_VISIBLE_DEVICES": "2", "RAY_ADDRESS": gcs}}
    code, started = agent(first, "copy", "start", stdin=spec)
    assert code == 0, started
    deadline = time.monotonic() + 90
    while True:
        code, listed = agent(first, "copy", "list")
        engine = {c["copy"]: c for c in listed["copies"]}["d7-c3"]
        if engine["healthy"] or not engine["running"] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    logs = "\n".join(agent(first, "copy", "logs", "--copy", "d7-c3", "--lines", "200")[1]["lines"])
    assert engine["healthy"], logs
    # Each stage ran on its own node, on the GPU that node was given and no other (Ray names 127.0.0.1 by
    # the host's address).
    assert re.search(r"pipeline stage 0 on \S+: GPUs 2$", logs, re.M) and re.search(r"pipeline stage 1 on \S+: GPUs 5$",
                                                                                   logs, re.M), logs
    assert {c["copy"]: c["healthy"] for c in listed["copies"]} == {"d7-c3": True, "d7-c3-ray": True}

    # A node of the copy's Ray dies (its machine's processes killed): the engine ends in its own words
    # (the health checks then restart the copy).
    os.killpg(node["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while copyproc.read_proc(started["pid"]) is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    (engine,) = [c for c in agent(first, "copy", "list")[1]["copies"] if c["copy"] == "d7-c3"]
    assert not engine["running"] and "RayWorkerError: a pipeline stage's Ray node died" in engine["log"], engine

    for machine, copy in ((first, "d7-c3"), (second, "d7-c3-ray"), (first, "d7-c3-ray")):
        code, stopped = agent(machine, "copy", "stop", "--copy", copy)
        assert code == 0 and stopped["forced"] is False, stopped
    for pid in (started["pid"], head["pid"], node["pid"]):
        assert copyproc.read_proc(pid) is None
    leftovers = [p for p in copyproc.machine_processes() if any(copyray.temp_dir(m.store, "d7-c3-ray") in word
                                                                for m in machines for word in p.argv)]
    assert leftovers == []
