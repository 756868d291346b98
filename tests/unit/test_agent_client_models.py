"""The agent client's model commands: the command line and stdin each sends (the hub token only inside the
stdin JSON), the typed results it reads, the agent's own parser accepting them, and the fake the unit tests use."""
import itertools
import json
import sys
from pathlib import Path

import pytest

from console.choices import ErrorKind
from machines import remote
from machines.agent_client import Agent, AgentError, ModelFile, ModelSpec
from machines.agent_results import HubCheck, PlacedModel
from machines.models import Machine
from tests.fakes import FakeAgents

sys.dont_write_bytecode = True  # keep agent/ free of __pycache__, as tests/agent does
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "agent"))
from fadenstack_agent import __main__ as agent_main  # noqa: E402
from fadenstack_agent import cli  # noqa: E402

# The agent imports a command's module only when that command runs: declare them all, as `known: ...` does.
agent_main.load_commands()

AGENT = ["/usr/bin/python3", "/opt/fadenstack/agent/a.pyz"]
TOKEN = "hf_secret_in_stdin_only"
SPEC = ModelSpec(repo="org/tiny", revision="ab" * 20, files=(
    ModelFile(path="config.json", digest="cd" * 32, size=595), ModelFile(path="model.safetensors", digest="ef" * 32, size=1 << 26)))
PLACED = {"event": "result", "repo": "org/tiny", "revision": "ab" * 20, "path": "/var/lib/fadenstack/models/org--tiny/" + "ab" * 20,
          "bytes": 595 + (1 << 26), "files": 2, "placed_at": 1.0}


class Sent:
    """What run_agent was asked to run, and what it answers (after one progress and one log event)."""

    def __init__(self, answer: dict):
        self.answer, self.argv, self.stdin, self.timeout = answer, [], None, None

    def __call__(self, conn, argv, *, stdin=None, timeout=None, on_event=None, abort=None):
        self.argv, self.stdin, self.timeout = list(argv), stdin, timeout
        if on_event:
            on_event({"event": "progress", "digest": "ef" * 32, "file": "model.safetensors", "bytes": 5, "total": 10, "rate": 2})
            on_event({"event": "log", "message": "not progress"})
        return self.answer


@pytest.fixture
def agent():
    return Agent(Machine(name="gpu-a", python_path="/usr/bin/python3", agent_path="/opt/fadenstack/agent/a.pyz"), conn=None)


def sent(monkeypatch, answer: dict) -> Sent:
    recorder = Sent(answer)
    monkeypatch.setattr(remote, "run_agent", recorder)
    return recorder


def test_model_place_sends_the_spec_on_stdin_and_reads_the_placed_model(monkeypatch, agent):
    recorder = sent(monkeypatch, PLACED)
    placed = agent.model_place(SPEC)
    assert recorder.argv == [*AGENT, "model", "place"]
    assert json.loads(recorder.stdin) == {"repo": "org/tiny", "revision": "ab" * 20, "files": [
        {"path": "config.json", "digest": "cd" * 32, "size": 595},
        {"path": "model.safetensors", "digest": "ef" * 32, "size": 1 << 26}]}
    assert placed == PlacedModel(repo="org/tiny", revision="ab" * 20, path=PLACED["path"], bytes=PLACED["bytes"], files=2)


def test_model_download_carries_the_token_inside_the_stdin_json_only_and_reports_progress(monkeypatch, agent):
    recorder = sent(monkeypatch, dict(PLACED, bytes_downloaded=1 << 26))
    seen = []
    placed = agent.model_download(SPEC, endpoint="https://huggingface.co", token=TOKEN, timeout=3600, on_progress=seen.append)
    assert recorder.argv == [*AGENT, "model", "download"] and TOKEN not in " ".join(recorder.argv)
    body = json.loads(recorder.stdin)
    assert (body["endpoint"], body["token"], body["repo"]) == ("https://huggingface.co", TOKEN, "org/tiny")
    assert placed.bytes_downloaded == 1 << 26 and [e["file"] for e in seen] == ["model.safetensors"]

    agent.model_download(SPEC, endpoint="https://huggingface.co", timeout=60)
    assert "token" not in json.loads(recorder.stdin)


def test_model_list_remove_and_hub_check_read_their_results(monkeypatch, agent):
    recorder = sent(monkeypatch, {"event": "result", "store": "/s", "free_bytes": 123, "models": [PLACED]})
    listed = agent.model_list()
    assert recorder.argv == [*AGENT, "model", "list"]
    assert listed.free_bytes == 123 and [m.repo for m in listed.models] == ["org/tiny"]

    recorder = sent(monkeypatch, {"event": "result", "repo": "org/tiny", "revision": "main", "freed": 4096})
    assert agent.model_remove(repo="org/tiny", revision="main") == 4096
    assert recorder.argv == [*AGENT, "model", "remove", "--repo", "org/tiny", "--revision", "main"]

    recorder = sent(monkeypatch, {"event": "result", "ok": True, "status": 200, "seconds": 0.2})
    assert agent.hub_check("https://huggingface.co", timeout=5) == HubCheck(ok=True, status=200, seconds=0.2)
    assert recorder.argv == [*AGENT, "hub", "check", "--url", "https://huggingface.co", "--timeout", "5"]
    assert recorder.timeout > 5


@pytest.mark.parametrize("call", [
    lambda a: a.model_place(SPEC),
    lambda a: a.model_list(),
    lambda a: a.model_remove(repo="org/tiny", revision="main"),
    lambda a: a.model_download(SPEC, endpoint="https://huggingface.co", token=TOKEN, timeout=60),
    lambda a: a.hub_check("http://198.18.0.1:8090", timeout=2.5),
], ids=["place", "list", "remove", "download", "hub-check"])
def test_the_agent_parses_every_model_command_line_the_client_sends(monkeypatch, agent, call):
    recorder = sent(monkeypatch, PLACED)
    call(agent)
    argv = recorder.argv[len(AGENT):]
    words = tuple(itertools.takewhile(lambda word: not word.startswith("-"), argv))
    assert cli.handler_for(cli.build_parser().parse_args(argv)) is cli.COMMANDS[words].handler


def test_the_fake_agent_keeps_placed_models_until_removed_and_fails_on_request():
    fakes = FakeAgents({"gpu-b": {"hub_error": (ErrorKind.UNREACHABLE, "connection refused")}})
    with fakes.open(Machine(name="gpu-a")) as agent:
        agent.model_download(SPEC, endpoint="http://hub", token=TOKEN, timeout=60)
        assert [m.repo for m in agent.model_list().models] == ["org/tiny"]
        assert agent.model_remove(repo="org/tiny", revision="ab" * 20) == 595 + (1 << 26)
        assert agent.model_list().models == () and agent.model_remove(repo="org/tiny", revision="ab" * 20) == 0
    with fakes.open(Machine(name="gpu-b")) as agent, pytest.raises(AgentError, match="connection refused") as failed:
        agent.hub_check("http://hub")
    assert failed.value.kind == ErrorKind.UNREACHABLE
