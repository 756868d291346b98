"""A stand-in for the server's agent client (machines.agent_client.Agent), for unit tests.

``FakeAgents(answers)`` replaces ``Agent.open``: each machine's agent answers
from ``answers[machine name]``, a dict shaped like the agent's own results
(``runtime``: what ``runtime status`` returns, ``ray``: what ``ray status``
returns), or fails with ``error`` (the SSH session) or ``ray_error`` (Ray on
the head). Every call is recorded as ``(machine name, method, kwargs)``.
"""
from __future__ import annotations

from contextlib import contextmanager

from machines import agent_client
from machines.agent_client import AgentError, AgentErrorKind


class FakeAgent:
    def __init__(self, fakes: FakeAgents, machine):
        self._fakes, self.machine = fakes, machine

    def _answer(self, method: str, **kwargs) -> dict:
        self._fakes.calls.append((self.machine.name, method, kwargs))
        return self._fakes.answers.get(self.machine.name, {})

    def runtime_status(self):
        return agent_client._runtime_status(self._answer("runtime_status").get("runtime") or {})

    def ray_status(self, *, head: str, timeout: float = 60):
        answer = self._answer("ray_status", head=head)
        if self._fakes.on_ray_status:
            self._fakes.on_ray_status()
        if "ray" not in answer:
            raise AgentError(answer.get("ray_error", "Ray is not running here."), kind=AgentErrorKind.RETRYABLE)
        return agent_client._ray_status(answer["ray"])

    def console_url(self) -> str:
        self._answer("console_url")
        return "http://198.18.0.1:8000"

    def file_fetch(self, spec, source, **kwargs) -> int:
        """The whole file arrives: its size is what crossed the network."""
        self._answer("file_fetch", digest=spec.digest, url=source.url, token=source.token, timeout=kwargs.get("timeout"))
        if kwargs.get("on_progress"):
            kwargs["on_progress"]({"event": "progress", "bytes": spec.size // 2, "rate": 1.0})
        return spec.size

    def __getattr__(self, method: str):
        # Commands that only act (start, stop, join, ...) succeed and are recorded.
        return lambda *args, **kwargs: self._answer(method, **kwargs) and None


class FakeAgents:
    def __init__(self, answers: dict[str, dict] | None = None):
        self.answers = answers if answers is not None else {}
        self.calls: list[tuple[str, str, dict]] = []
        self.on_ray_status = None  # called whenever Ray's node list is asked for (to look at the database then)

    @contextmanager
    def open(self, machine):
        error = self.answers.get(machine.name, {}).get("error")
        if error:
            raise AgentError(error, kind=AgentErrorKind.UNREACHABLE)
        yield FakeAgent(self, machine)

    def install(self, monkeypatch) -> FakeAgents:
        monkeypatch.setattr(agent_client.Agent, "open", self.open)
        return self
