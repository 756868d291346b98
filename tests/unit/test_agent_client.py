"""The server's agent client: the command line each method sends, the result it reads, and the error
kinds held against the agent's own list."""
import json
import sys
from pathlib import Path

import pytest

from console.choices import ErrorKind
from machines import agent_client, remote
from machines.agent_client import Agent, FileSource, FileSpec
from machines.models import Machine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "agent"))
from fadenstack_agent import protocol  # noqa: E402 - the agent's package, read from agent/ as machines run it


def test_the_error_kinds_are_the_agent_s_own_list():
    assert tuple(kind.value for kind in ErrorKind) == protocol.ERROR_KINDS


class Sent:
    """What run_agent was asked to run, and what it answers."""

    def __init__(self, answer: dict | None = None):
        self.argv: list[str] = []
        self.stdin: bytes | None = None
        self.answer = answer or {"event": "result"}

    def __call__(self, conn, argv, *, stdin=None, timeout=None, on_event=None, abort=None):
        self.argv, self.stdin = list(argv), stdin
        if on_event:
            on_event({"event": "progress", "bytes": 5, "total": 10, "rate": 2.0})
            on_event({"event": "log", "message": "not progress"})
        return self.answer


@pytest.fixture
def agent():
    machine = Machine(name="gpu-a", python_path="/usr/bin/python3", agent_path="/opt/fadenstack/agent/a.pyz")
    return Agent(machine, conn=None)


def sent(monkeypatch, answer=None) -> Sent:
    recorder = Sent(answer)
    monkeypatch.setattr(remote, "run_agent", recorder)
    return recorder


AGENT = ["/usr/bin/python3", "/opt/fadenstack/agent/a.pyz"]


@pytest.mark.parametrize(("call", "argv"), [
    (lambda a: a.runtime_stop(), ["runtime", "stop"]),
    (lambda a: a.image_load("ab" * 32, driver="docker"), ["image", "load", "--digest", "ab" * 32, "--driver", "docker"]),
    (lambda a: a.runtime_start("ab" * 32, driver="podman", cluster="gpu-room"),
     ["runtime", "start", "--digest", "ab" * 32, "--driver", "podman", "--cluster", "gpu-room"]),
    (lambda a: a.runtime_start("ab" * 32, driver="process", cluster="lab-room"),
     ["runtime", "start", "--digest", "ab" * 32, "--driver", "process", "--cluster", "lab-room"]),
    # No runtime in use: the agent is left to pick, and says there is none.
    (lambda a: a.image_load("ab" * 32, driver=""), ["image", "load", "--digest", "ab" * 32]),
    (lambda a: a.serve_start(bind="198.18.1.11", port=7470), ["blob", "serve", "start", "--bind", "198.18.1.11", "--port", "7470"]),
    # The cluster's file-server token goes on stdin, never in the arguments.
    (lambda a: a.serve_start(bind="198.18.1.11", port=7470, token="t" * 40),
     ["blob", "serve", "start", "--bind", "198.18.1.11", "--port", "7470", "--token-stdin"]),
    (lambda a: a.serve_stop(), ["blob", "serve", "stop"]),
    (lambda a: a.ray_start_head(address="198.18.1.11", port=6379, gpus=8),
     ["ray", "start-head", "--address", "198.18.1.11", "--port", "6379", "--num-gpus", "8"]),
    (lambda a: a.ray_join(head="198.18.1.11:6379", address="198.18.1.12", gpus=4),
     ["ray", "join", "--head", "198.18.1.11:6379", "--address", "198.18.1.12", "--num-gpus", "4"]),
    (lambda a: a.ray_reach(head="198.18.1.11:6379"), ["ray", "reach", "--head", "198.18.1.11:6379"]),
])
def test_each_command_is_one_argument_list_after_the_machine_s_agent(monkeypatch, agent, call, argv):
    recorder = sent(monkeypatch)
    call(agent)
    assert recorder.argv == [*AGENT, *argv]


def test_the_heartbeat_token_goes_on_stdin_never_on_the_command_line(monkeypatch, agent):
    recorder = sent(monkeypatch)
    agent.heartbeat_start(url="http://198.18.0.1:8000/agent/heartbeat/", interval=10, token="s3cret-token")
    assert "s3cret-token" not in " ".join(recorder.argv)
    assert recorder.stdin == b"s3cret-token\n"


def test_a_file_fetch_sends_its_spec_on_stdin_and_reports_progress_only(monkeypatch, agent):
    recorder = sent(monkeypatch, {"event": "result", "bytes_fetched": 10})
    seen = []
    spec = FileSpec(digest="ab" * 32, size=10, chunk_size=8, chunk_hashes=["c1", "c2"])

    fetched = agent.file_fetch(spec, FileSource(url="http://198.18.1.11:7470/blobs/" + "ab" * 32), timeout=30, on_progress=seen.append)

    assert fetched == 10 and recorder.argv == [*AGENT, "blob", "fetch"]
    assert json.loads(recorder.stdin) == {"digest": "ab" * 32, "size": 10, "chunk_size": 8, "chunk_hashes": ["c1", "c2"],
                                          "source": {"url": "http://198.18.1.11:7470/blobs/" + "ab" * 32}}
    assert "token" not in recorder.stdin.decode() and [e["event"] for e in seen] == ["progress"]


def test_ray_status_reads_the_node_list(monkeypatch, agent):
    sent(monkeypatch, {"event": "result", "alive_nodes": 1, "gpus": 8, "nodes": [
        {"address": "198.18.1.11", "alive": True, "gpus": 8, "node_id": "n" * 80},
        {"address": "198.18.1.12", "alive": False, "gpus": 4, "node_id": "m"}]})

    status = agent.ray_status(head="198.18.1.11:6379")

    assert list(status.alive()) == ["198.18.1.11"]
    assert status.alive()["198.18.1.11"].gpus == 8 and len(status.alive()["198.18.1.11"].node_id) == 64


def test_runtime_status_reads_the_runtime_and_its_ray(monkeypatch, agent):
    sent(monkeypatch, {"event": "result", "state": "started", "digest": "ab" * 32,
                       "ray": {"running": True, "gcs_address": "198.18.1.11:6379"}})

    status = agent.runtime_status()

    assert (status.state, status.digest, status.ray_running, status.gcs_address) == ("started", "ab" * 32, True, "198.18.1.11:6379")


def test_a_machine_without_an_agent_is_refused_before_any_connection(monkeypatch):
    monkeypatch.setattr(remote, "connect", lambda target: pytest.fail("connected"))
    with pytest.raises(agent_client.AgentError, match="gpu-a has no agent yet") as refused:
        with Agent.open(Machine(name="gpu-a")):
            pass
    assert refused.value.kind == ErrorKind.NOT_RETRYABLE


def test_the_firewall_spec_goes_on_stdin_and_the_cluster_on_the_command_line(monkeypatch, agent):
    recorder = sent(monkeypatch, {"event": "result", "table": "inet fadenstack_gpu-room", "replaced": ["fadenstack_old"]})
    spec = {"members": ["198.18.1.11"], "console": [], "gateway": [], "ports": {"gcs": 6379, "copies": [8100, 8199], "files": 7470}}

    state = agent.firewall_write(cluster="gpu-room", spec=spec)

    assert recorder.argv == [*AGENT, "firewall", "write", "--cluster", "gpu-room"] and json.loads(recorder.stdin) == spec
    assert state.present and state.replaced == ("fadenstack_old",)
    recorder = sent(monkeypatch, {"event": "result", "table": "inet fadenstack_gpu_room", "removed": True})
    assert not agent.firewall_remove(cluster="gpu-room").present
    assert recorder.argv == [*AGENT, "firewall", "remove", "--cluster", "gpu-room"]
    recorder = sent(monkeypatch, {"event": "result", "present": True, "ruleset": "table inet fadenstack_gpu_room {}"})
    assert agent.firewall_status(cluster="gpu-room").present
    assert recorder.argv == [*AGENT, "firewall", "status", "--cluster", "gpu-room"]
