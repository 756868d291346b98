"""``copy start|list|stop`` in the runtime container of a real Podman and Docker (as
``test_engines_real``): a busybox image whose ``vllm`` is a shell script that prints what it was
given and serves ``/health`` with busybox's httpd on the spec's address and port. The lab test
(``tests/lab/test_copies_lab.py``) runs the lab's real engine in the real runtime image."""

import json
import os
import resource
import uuid

import pytest

from .dockerd import docker_env  # noqa: F401  (a fixture)
from .imagehelpers import Machine
from .test_engines_real import GLOBAL_ARGS, _hard_limit, agent, busybox_rootfs, hold_runtime_image
from .test_engines_real import engine  # noqa: F401  (a fixture)
from .test_copies import free_port

pytestmark = pytest.mark.xdist_group("lab")

APPLETS = ("sh", "sleep", "httpd", "mkdir", "kill", "cat", "true")
FAKE_VLLM = """#!/bin/sh
echo "fake engine: $* CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES pace=$FADEN_LAB_ENGINE_PACE"
while [ $# -gt 0 ]; do
    case "$1" in --port) port=$2; shift;; --host) host=$2; shift;; esac
    shift
done
mkdir -p /tmp/www && : > /tmp/www/health
exec httpd -f -p "$host:$port" -h /tmp/www
"""


@pytest.fixture
def world(engine, tmp_path):
    """A machine whose runtime (a busybox image with the fake vllm) is loaded and started for a cluster."""
    tag = "localhost/faden-test-%s:1" % uuid.uuid4().hex[:10]
    label = "faden-test-" + uuid.uuid4().hex[:10]
    busybox_rootfs(tmp_path, applets=APPLETS, bin_files={"vllm": FAKE_VLLM}, tmp=True)
    machine = Machine(tmp_path, "m1")
    machine.env.update(engine.env)
    os.makedirs(machine.store)
    config = {"machine_name": label, "engine_env": {"FADEN_LAB_ENGINE_PACE": "321"},
              engine.name: {"global_args": GLOBAL_ARGS[engine.name], "gpus": "none",
                            "ulimits": {"nofile": _hard_limit(resource.RLIMIT_NOFILE, 65536),
                                        "nproc": _hard_limit(resource.RLIMIT_NPROC, 4096)}}}
    with open(machine.env["FADEN_AGENT_CONFIG"], "w") as fh:
        json.dump(config, fh)
    world = {"engine": engine, "machine": machine, "tag": tag, "label": label, "rootfs": tmp_path / "rootfs.tar",
             "cluster": "c-" + uuid.uuid4().hex[:6]}
    digest = hold_runtime_image(world)
    assert agent(machine, "image", "load", "--digest", digest, "--driver", engine.name)[0] == 0
    code, final = agent(machine, "runtime", "start", "--digest", digest, "--cluster", world["cluster"],
                        "--driver", engine.name)
    assert code == 0, final
    yield world
    agent(machine, "runtime", "stop")
    for name in engine.containers(label):
        engine.run("rm", "-f", name, check=False)
    engine.run("rmi", "-f", tag, check=False)


def test_a_copy_runs_in_the_clusters_container_is_listed_and_stopped_inside_it(world):
    engine, machine, cluster = world["engine"], world["machine"], world["cluster"]
    port = free_port()
    spec = {"copy": "d1-c1", "cluster": cluster, "env": {"CUDA_VISIBLE_DEVICES": "2,3"}, "port": port,
            "address": "127.0.0.1", "argv": ["vllm", "serve", "/var/lib/fadenstack/models/m", "--host", "127.0.0.1",
                                             "--port", str(port), "--served-model-name", "it's \"quoted\" $(id)"]}
    code, started = machine.run(["copy", "start"], stdin=spec, timeout=120)
    final = started[-1]
    assert code == 0, final
    assert (final["driver"], final["container"], final["already"]) == (engine.name, "fadenstack-" + cluster, False)
    assert final["host_pid"] and final["host_pid"] != final["pid"]          # the container's own pid namespace
    code, listed = machine.run(["copy", "list"])
    (shown,) = listed[-1]["copies"]
    assert (shown["running"], shown["healthy"], shown["log"]) == (True, True, None), shown
    with open(os.path.join(machine.store, "copies", "out", "d1-c1.log")) as fh:
        said = fh.read()
    # The argv as given (no shell saw it); the spec's env and the machine's engine_env by name.
    assert ("fake engine: serve /var/lib/fadenstack/models/m --host 127.0.0.1 --port %d --served-model-name "
            "it's \"quoted\" $(id) CUDA_VISIBLE_DEVICES=2,3 pace=321" % port) in said
    seen = engine.run("exec", "fadenstack-" + cluster, "cat", "/proc/%d/cmdline" % final["pid"]).stdout
    assert seen.split(b"\0")[:2] == [b"httpd", b"-f"]                         # the engine is the pid recorded

    code, again = machine.run(["copy", "start"], stdin=spec, timeout=120)
    assert again[-1]["already"] is True and again[-1]["pid"] == final["pid"]
    code, stopped = machine.run(["copy", "stop", "--copy", "d1-c1", "--timeout", "5"], timeout=120)
    assert code == 0 and stopped[-1]["stopped"] is True and stopped[-1]["forced"] is False, stopped
    assert not os.path.exists("/proc/%d" % final["host_pid"]) or \
        open("/proc/%d/stat" % final["host_pid"]).read().rsplit(")", 1)[1].split()[0] == "Z"
    assert machine.run(["copy", "list"])[1][-1]["copies"] == []


def test_runtime_stop_ends_the_containers_copies_and_clears_their_records(world):
    machine, cluster = world["machine"], world["cluster"]
    port = free_port()
    spec = {"copy": "d1-c2", "cluster": cluster, "env": {"CUDA_VISIBLE_DEVICES": "0"}, "port": port,
            "address": "127.0.0.1", "argv": ["vllm", "serve", "/m", "--host", "127.0.0.1", "--port", str(port)]}
    code, events = machine.run(["copy", "start"], stdin=spec, timeout=120)
    assert code == 0, events[-1]
    code, refused = machine.run(["copy", "start"], stdin=dict(spec, copy="d1-c3", cluster="another"), timeout=120)
    assert refused[-1]["kind"] == "not_retryable" and "is cluster %s's, not another's" % cluster in refused[-1]["message"]
    code, stopped = machine.run(["runtime", "stop"], timeout=120)
    assert code == 0 and stopped[-1]["copies"] == ["d1-c2"] and stopped[-1]["container_removed"] is True
    assert machine.run(["copy", "list"])[1][-1]["copies"] == []
