"""The agent client's NCCL test (``Agent.allreduce_run``) and the fake agent's replay of it."""
import json

import pytest

from console.choices import ErrorKind
from machines import agent_client, remote
from machines.agent_client import Agent
from machines.agent_results import AllReduceResult
from machines.models import Machine
from tests.fakes import FakeAgent, FakeAgents

SPEC = {"cluster": "gpu-room", "nodes": [{"name": "node-0", "address": "198.18.1.11", "gpus": 8}], "minbytes": 1048576,
        "maxbytes": 67108864, "iters": 5, "warmup": 1, "check": True, "timeout": 600}


def test_the_spec_goes_on_stdin_each_line_comes_to_on_line_and_the_result_is_read(monkeypatch):
    seen = {}

    def run_agent(conn, argv, *, stdin=None, timeout=None, on_event=None, abort=None):
        seen.update(argv=list(argv), stdin=stdin, timeout=timeout, abort=abort)
        on_event({"event": "progress", "line": "# nThread 1 nGpus 8"})
        on_event({"event": "progress", "bytes": 5})  # not a line: not passed on
        on_event({"event": "progress", "line": ""})
        return {"event": "result", "exit_status": 1, "timed_out": True, "stderr_tail": ["mpirun noticed ..."]}

    monkeypatch.setattr(remote, "run_agent", run_agent)
    machine = Machine(name="gpu-a", python_path="/usr/bin/python3", agent_path="/opt/fadenstack/agent/a.pyz")
    lines: list[str] = []
    stop = lambda: None  # noqa: E731
    result = Agent(machine, conn=None).allreduce_run(SPEC, on_line=lines.append, abort=stop, timeout=700)
    assert seen["argv"] == ["/usr/bin/python3", "/opt/fadenstack/agent/a.pyz", "allreduce", "run"]
    assert json.loads(seen["stdin"]) == SPEC and (seen["timeout"], seen["abort"]) == (700, stop)
    assert lines == ["# nThread 1 nGpus 8", ""]
    assert result == AllReduceResult(exit_status=1, timed_out=True, stderr_tail=("mpirun noticed ...",))


class Box:
    name = "gpu-a"


def test_the_fake_replays_a_recorded_run_without_its_source_line():
    lines: list[str] = []
    result = FakeAgent(FakeAgents({"gpu-a": {"allreduce": {"fixture": "t4-3nodes-no-validation.txt"}}}), Box()).allreduce_run(
        SPEC, on_line=lines.append, timeout=60)
    assert lines[0].startswith("# nThread 1 nGpus 1 minBytes 104857600") and lines[-1] == "# Avg bus bandwidth    : 0.58536"
    assert result == AllReduceResult(exit_status=0, timed_out=False, stderr_tail=())


def test_the_fake_stops_when_abort_gives_a_reason():
    fakes = FakeAgents({"gpu-a": {"allreduce": {"lines": ["one", "two", "three"]}}})
    lines: list[str] = []
    with pytest.raises(agent_client.AgentError) as stopped:
        FakeAgent(fakes, Box()).allreduce_run(SPEC, on_line=lines.append, abort=lambda: "Stopped by ann." if lines[1:] else None,
                                              timeout=60)
    assert lines == ["one", "two"]
    assert (stopped.value.message, stopped.value.kind) == ("Stopped by ann.", ErrorKind.UNREACHABLE)
