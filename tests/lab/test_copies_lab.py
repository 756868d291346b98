"""A model's copy on a lab machine under Podman, through the agent as the console drives it: the
real runtime image (`faden lab images`: Debian, Ray and the lab's engine at /usr/local/bin/vllm)
loaded and started on lab-a, the lab hub's small model placed in its store, `copy start` with the
spec on stdin, a chat answer over the lab's fabric from the console's host, `copy stop`.

One lab per host: run it as

    flock /tmp/lab.lock .venv/bin/python -m pytest tests/lab/test_copies_lab.py -p no:cacheprovider
"""
import hashlib
import http.client
import json
import os
import shutil
import subprocess
import time
import zipapp
from pathlib import Path

import pytest

from lab.harness import SSH_OPTIONS, wait_until
from lab.hub_models import MODELS, ModelStore

pytestmark = pytest.mark.lab

REPO = Path(__file__).resolve().parent.parent.parent
MACHINE, MGMT, FABRIC = "lab-a", "198.18.0.11", "198.18.1.11"
AGENT = "/tmp/fadenstack-agent.pyz"  # in the machine's own /tmp
CLUSTER, PORT = "copies", 8100
TINY = MODELS["fadenstack-lab/tiny-chat"]
TIMINGS = {}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def hold(store: Path, source: Path, digest: str) -> None:
    """A file in the machine's store as a finished blob (the blob transfer is not what this tests)."""
    target = store / "blobs" / digest
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        try:
            os.link(source, target)
        except OSError:
            shutil.copyfile(source, target)


class Machine:
    def __init__(self, lab):
        self.lab = lab

    def agent(self, *args, stdin: dict | None = None, timeout: float = 300) -> dict:
        """The agent's last line on the machine, over SSH (a spec on its stdin)."""
        command = "python3 %s %s" % (AGENT, " ".join("'%s'" % a for a in args))
        done = subprocess.run(self.lab.ssh_argv(MGMT, command), input=json.dumps(stdin) if stdin else "",
                              capture_output=True, text=True, timeout=timeout)
        lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        assert lines, f"no answer from the agent on {MACHINE} (exit {done.returncode}): {done.stdout} {done.stderr}"
        return lines[-1]


@pytest.fixture(scope="module")
def machine(lab, tmp_path_factory):
    """lab-a on Podman with the runtime image loaded and started for the cluster, and the small model placed."""
    lab.runtime("podman", MACHINE)
    on = Machine(lab)
    try:
        work = tmp_path_factory.mktemp("copies-lab")
        source = work / "agent"
        shutil.copytree(REPO / "agent", source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        zipapp.create_archive(source, work / "agent.pyz", main="fadenstack_agent.__main__:main")
        copied = subprocess.run(["scp", "-q", "-i", str(lab.key), *SSH_OPTIONS, str(work / "agent.pyz"),
                                 f"root@{MGMT}:{AGENT}"], capture_output=True, text=True, timeout=60)
        assert copied.returncode == 0, copied.stderr

        started = time.monotonic()
        image = next(path for path in lab.images() if "x86_64" in path.name)
        TIMINGS["images"] = round(time.monotonic() - started, 1)
        store = Path(lab.state_dir) / "machines" / MACHINE / "store"
        digest = sha256_of(image)
        hold(store, image, digest)
        started = time.monotonic()
        loaded = on.agent("image", "load", "--digest", digest, "--driver", "podman", timeout=600)
        assert loaded["event"] == "result", loaded
        TIMINGS["image_load"] = round(time.monotonic() - started, 1)
        assert loaded["manifest"]["version"] == "2.3.0"  # the build that carries the engine and the NCCL test
        running = on.agent("runtime", "start", "--digest", digest, "--cluster", CLUSTER, "--driver", "podman")
        assert running["event"] == "result", running

        files = ModelStore().files(TINY)
        for entry in files.values():
            hold(store, entry.local_path, entry.sha256)
        placed = on.agent("model", "place", stdin={"repo": TINY.repo_id, "revision": TINY.commit_sha, "files": [
            {"path": path, "digest": entry.sha256, "size": entry.size} for path, entry in files.items()]})
        assert placed["event"] == "result", placed
        yield on, placed["path"]
    finally:
        on.agent("runtime", "stop")
        lab.runtime("process", MACHINE)
        print(f"\ncopies in the lab: {json.dumps(TIMINGS, sort_keys=True)}")


def chat(stream: bool, max_tokens: int = 16) -> tuple:
    """A chat with the copy from this host (the console's) over the fabric: (status, answer or events, ttft)."""
    conn = http.client.HTTPConnection(FABRIC, PORT, timeout=30)
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Say hello to the lab."}],
            "max_tokens": max_tokens, "stream": stream}
    sent = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    answer = conn.getresponse()
    if not stream:
        return answer.status, json.loads(answer.read()), None
    events, first = [], None
    for line in answer:
        if line.startswith(b"data: "):
            first = first or time.monotonic() - sent
            events.append(line[6:].strip())
    return answer.status, events, first


def test_a_copy_starts_in_the_runtime_container_answers_over_the_fabric_and_stops(machine):
    on, model_path = machine
    spec = {"copy": "d1-c1", "cluster": CLUSTER, "port": PORT, "address": FABRIC,
            "env": {"CUDA_VISIBLE_DEVICES": "0,1"},
            "argv": ["vllm", "serve", model_path, "--served-model-name", "tiny-chat", "--host", FABRIC, "--port",
                     str(PORT), "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.45",
                     "--max-model-len", "2048", "--dtype", "auto", "--disable-log-requests"]}
    started = time.monotonic()
    copy = on.agent("copy", "start", stdin=spec)
    assert copy["event"] == "result" and copy["running"] is True, copy
    assert (copy["driver"], copy["container"]) == ("podman", f"fadenstack-{CLUSTER}")
    assert copy["env_names"] == ["CUDA_VISIBLE_DEVICES", "FADEN_LAB_ENGINE_PACE"]   # the lab's pace, by the config

    def answering():   # as the console does: a starting copy is listed until its engine answers /health
        (shown,) = on.agent("copy", "list")["copies"]
        assert shown["running"], shown["log"]
        return shown if shown["healthy"] else None

    wait_until(answering, timeout=60, what="the copy to answer /health",
               meanwhile=lambda: "\n".join(on.agent("copy", "logs", "--copy", "d1-c1")["lines"]))
    TIMINGS["copy_start_to_healthy"] = round(time.monotonic() - started, 2)

    status, answer, _ = chat(stream=False)
    assert status == 200 and answer["model"] == "tiny-chat", answer
    assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] <= 16
    status, events, ttft = chat(stream=True)
    assert status == 200 and events[-1] == b"[DONE]"
    text = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == answer["choices"][0]["message"]["content"]               # the same prompt, the same answer
    TIMINGS["ttft_over_fabric_ms"] = round(ttft * 1000, 1)

    logs = on.agent("copy", "logs", "--copy", "d1-c1", "--lines", "200")
    assert any("Application startup complete." in line for line in logs["lines"])
    stopped = on.agent("copy", "stop", "--copy", "d1-c1")
    assert stopped["event"] == "result" and stopped["stopped"] is True and stopped["forced"] is False, stopped
    assert on.agent("copy", "list")["copies"] == []
    with pytest.raises(OSError):
        http.client.HTTPConnection(FABRIC, PORT, timeout=2).request("GET", "/health")
