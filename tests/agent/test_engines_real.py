"""The docker and podman drivers against a real engine: ``image load``,
``runtime start|status|stop`` through the agent's command line, on a tiny
image of busybox written by the lab's archive writer (Ray inside a container
is not run here).

Podman runs as root on this host with the lab's settings (runc, cgroupfs,
ulimits at or below the host's hard limits).  Docker is the daemon that
answers here, else a private one (Debian's docker.io, ``dockerd.py``) started
once for the session, given to the test's ``docker`` calls and to the agents
it starts as DOCKER_HOST.  Every name is unique (the machine label included: a machine only
removes its own leftovers), and everything made here is removed at the end.
The tests run in the lab's xdist worker, one after another with the lab's: an
engine and two CPUs shared with a lab that starts clusters would make the
start checks race the machine rather than test the agent.
"""

import io
import json
import os
import resource
import shutil
import subprocess
import tarfile
import uuid

import pytest

from .dockerd import docker_env  # noqa: F401  (a fixture)
from .imagehelpers import Machine

pytestmark = pytest.mark.xdist_group("lab")

GLOBAL_ARGS = {"podman": ["--runtime", "runc", "--cgroup-manager", "cgroupfs"], "docker": []}
BUSYBOX = shutil.which("busybox") or "/bin/busybox"
APPLETS = ("sh", "sleep", "echo", "cat", "ls", "true")


def _hard_limit(kind, cap):
    hard = resource.getrlimit(kind)[1]
    return cap if hard == resource.RLIM_INFINITY else min(cap, hard)


def engine_missing(name):
    if shutil.which(name) is None:
        return "%s is not installed" % name
    if not os.path.exists(BUSYBOX):
        return "busybox (busybox-static) is needed to build the test image"
    if name == "podman" and os.geteuid() != 0:
        return "the podman test runs as root, as the lab's machines do"
    return None


class Engine:
    """The engine under test, run directly (as the test's own hands); ``env``: what its calls and the agents'
    environment add (DOCKER_HOST of a private daemon)."""

    def __init__(self, name, env=None):
        self.name = name
        self.env = dict(env or {})

    def run(self, *args, check=True):
        proc = subprocess.run([self.name] + GLOBAL_ARGS[self.name] + list(args), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env=dict(os.environ, **self.env), timeout=120)
        if check:
            assert proc.returncode == 0, proc.stderr.decode()
        return proc

    def containers(self, machine):
        """{name: labels} of the containers labelled with ``machine``, running or not."""
        proc = self.run("ps", "-a", "--filter", "label=fadenstack.machine=" + machine, "--format", "{{.Names}}")
        return {name: json.loads(self.run("inspect", "--format", "{{json .Config.Labels}}", name).stdout)
                for name in proc.stdout.decode().split()}


def busybox_rootfs(tmp_path, applets=APPLETS, bin_files=None, tmp=False):
    """``tmp_path/rootfs.tar``: busybox with ``applets`` linked in /bin, ``bin_files`` ({name: script})
    beside them, and a world-writable /tmp when asked."""
    root = tmp_path / "rootfs"
    (root / "bin").mkdir(parents=True)
    shutil.copy(BUSYBOX, str(root / "bin" / "busybox"))
    for applet in applets:
        os.symlink("busybox", str(root / "bin" / applet))
    for name, script in (bin_files or {}).items():
        (root / "bin" / name).write_text(script)
        (root / "bin" / name).chmod(0o755)
    if tmp:
        (root / "tmp").mkdir(mode=0o1777)
    with tarfile.open(str(tmp_path / "rootfs.tar"), "w") as tar:
        tar.add(str(root), arcname=".")
    return tmp_path / "rootfs.tar"


@pytest.fixture(params=["podman", "docker"])
def engine(request):
    why = engine_missing(request.param)
    if why:
        pytest.skip(why)
    return Engine(request.param, request.getfixturevalue("docker_env") if request.param == "docker" else None)


@pytest.fixture
def world(engine, tmp_path):
    """A machine (store, config naming no driver) and a busybox root file system to make images of."""
    tag = "localhost/faden-test-%s:1" % uuid.uuid4().hex[:10]
    machine_label = "faden-test-" + uuid.uuid4().hex[:10]
    busybox_rootfs(tmp_path)
    machine = Machine(tmp_path, "m1")
    machine.env.update(engine.env)
    os.makedirs(machine.store)
    limits = {"nofile": _hard_limit(resource.RLIMIT_NOFILE, 65536),
              "nproc": _hard_limit(resource.RLIMIT_NPROC, 4096)}
    config = {"machine_name": machine_label,
              engine.name: {"global_args": GLOBAL_ARGS[engine.name], "ulimits": limits, "gpus": "none"}}
    with open(machine.env["FADEN_AGENT_CONFIG"], "w") as fh:
        json.dump(config, fh)
    yield {"engine": engine, "machine": machine, "tag": tag, "label": machine_label, "rootfs": tmp_path / "rootfs.tar",
           "suffix": uuid.uuid4().hex[:6]}
    for name in engine.containers(machine_label):
        engine.run("rm", "-f", name, check=False)
    engine.run("rmi", "-f", tag, check=False)


def hold_runtime_image(world, data=None, **labels):
    """A runtime image of busybox (a docker-archive with the build's labels, and ``labels`` besides) in the
    machine's store, or ``data`` as it is; its digest."""
    import hashlib

    from lab import archive

    if data is None:
        out = world["rootfs"].parent
        layer = archive.layer_from_tar(world["rootfs"], out / "layer.tar.gz")
        build = {"org.fadenstack.runtime.name": "Test Runtime", "org.fadenstack.runtime.version": "2.1.0",
                 "org.fadenstack.runtime.arch": "x86_64", "org.fadenstack.runtime.accelerator-vendor": "none",
                 "org.fadenstack.runtime.certified": "true"}
        config = archive.image_config(arch="x86_64", labels=dict(build, **labels), layers=[layer])
        archive.archive_write(out / "runtime.img", tag=world["tag"], config=config, layers=[layer])
        data = (out / "runtime.img").read_bytes()
    machine = world["machine"]
    digest = hashlib.sha256(data).hexdigest()
    os.makedirs(os.path.join(machine.store, "blobs"), exist_ok=True)
    with open(machine.blob(digest), "wb") as fh:
        fh.write(data)
    return digest


def tarball_of(members):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def agent(machine, *args):
    code, events = machine.run(list(args), timeout=180)
    return code, events[-1]


def test_an_image_is_loaded_started_for_its_cluster_and_stopped(world):
    engine, machine, label = world["engine"], world["machine"], world["label"]
    cluster, other = "t1-" + world["suffix"], "t0-" + world["suffix"]
    digest = hold_runtime_image(world)

    code, final = agent(machine, "image", "load", "--digest", digest, "--driver", engine.name)
    assert code == 0, final
    assert (final["driver"], final["image_ref"], final["already_loaded"]) == (engine.name, world["tag"], False)
    assert engine.run("image", "inspect", world["tag"]).returncode == 0
    code, final = agent(machine, "image", "load", "--digest", digest, "--driver", engine.name)
    assert code == 0 and final["already_loaded"] is True
    # The store cleared (its record of the load gone): the engine holds this very build, nothing to load.
    os.remove(os.path.join(machine.store, "runtime", "loaded.json"))
    code, events = machine.run(["image", "load", "--digest", digest, "--driver", engine.name], timeout=180)
    assert code == 0 and events[-1]["image_ref"] == world["tag"]
    assert any("holds the runtime image" in e.get("message", "") for e in events if e.get("event") == "log")

    # What an earlier cluster left on this machine (created, never started).
    engine.run("create", "--name", "fadenstack-" + other, "--label", "fadenstack.cluster=" + other,
               "--label", "fadenstack.machine=" + label, world["tag"], "sleep", "600")
    code, final = agent(machine, "runtime", "start", "--digest", digest, "--cluster", cluster,
                        "--driver", engine.name)
    assert code == 0, final
    assert final["container"] == "fadenstack-" + cluster and final["removed"] == ["fadenstack-" + other]
    assert (final["driver"], final["image"], final["already_running"]) == (engine.name, world["tag"], False)
    found = engine.containers(label)
    assert list(found) == ["fadenstack-" + cluster]
    ours = {k: v for k, v in found["fadenstack-" + cluster].items() if k.startswith("fadenstack.")}
    assert ours == {"fadenstack.cluster": cluster, "fadenstack.machine": label}  # besides the image's own
    # The store is the container's /var/lib/fadenstack.
    with open(os.path.join(machine.store, "hello.txt"), "w") as fh:
        fh.write("from the machine")
    seen = engine.run("exec", "fadenstack-" + cluster, "cat", "/var/lib/fadenstack/hello.txt")
    assert seen.stdout.decode() == "from the machine"

    code, final = agent(machine, "runtime", "start", "--digest", digest, "--cluster", cluster,
                        "--driver", engine.name)
    assert code == 0 and final["already_running"] is True
    code, final = agent(machine, "runtime", "status")
    assert final["state"] == "started" and final["cluster"] == cluster and final["driver"]["engine"] == engine.name
    assert final["container"]["state"] == "running" and final["container"]["log"] is None
    assert final["ray"]["running"] is False

    code, final = agent(machine, "runtime", "stop")
    assert code == 0 and final["container_removed"] is True and final["was_started"] is True
    assert engine.containers(label) == {}
    code, final = agent(machine, "runtime", "stop")
    assert code == 0 and final["container_removed"] is False
    code, final = agent(machine, "runtime", "status")
    assert final["state"] == "stopped" and final["container"]["state"] == "absent"


def test_a_container_that_exits_at_once_is_not_retryable_in_its_own_words(world):
    engine, machine = world["engine"], world["machine"]
    cluster = "t2-" + world["suffix"]
    digest = hold_runtime_image(world, **{"org.fadenstack.runtime.command": json.dumps([
        "sh", "-c", "echo starting the engine; echo no GPU answers on this machine >&2; exit 3"])})
    assert agent(machine, "image", "load", "--digest", digest, "--driver", engine.name)[0] == 0
    code, final = agent(machine, "runtime", "start", "--digest", digest, "--cluster", cluster,
                        "--driver", engine.name)
    assert code == 1 and final["kind"] == "not_retryable", final
    assert final["message"].startswith("The runtime container fadenstack-%s stopped right after it started "
                                       "(exit status 3)" % cluster)
    assert "no GPU answers on this machine" in final["message"] and "starting the engine" in final["message"]
    code, final = agent(machine, "runtime", "status")
    assert final["state"] == "none" and final["container"] is None or final["container"]["state"] != "running"
    assert agent(machine, "runtime", "stop")[0] == 0


def test_an_archive_the_engine_refuses_is_not_retryable_with_its_words(world):
    engine, machine = world["engine"], world["machine"]
    digest = hold_runtime_image(world, tarball_of({"manifest.json": json.dumps([{"Config": "c.json"}]).encode(),
                                                    "c.json": json.dumps({"config": {"Labels": {
                                                        "org.fadenstack.runtime.name": "Not an image",
                                                        "org.fadenstack.runtime.version": "1"}}}).encode()}))
    code, final = agent(machine, "image", "load", "--digest", digest, "--driver", engine.name)
    assert code == 1 and final["kind"] == "not_retryable", final
    assert final["message"].startswith("%s refused it (exit status" % engine.name)
    assert "could not be loaded: " in final["message"]
    assert len(final["message"].split("could not be loaded: ", 1)[1]) > 20  # the engine's own words
    code, final = agent(machine, "runtime", "start", "--digest", digest, "--cluster", "t3-" + world["suffix"],
                        "--driver", engine.name)
    assert final["kind"] == "not_retryable" and "No runtime image is loaded" in final["message"]
