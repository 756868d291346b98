"""What the lab tests of deployments share: the lab hub's small model imported into the console, calls
through the gateway, a caller that keeps calling while a copy is killed or the console restarts, and the
model's copies cleared from the machines. The deployments module (the `process` runtime) and the cluster
life module (Podman, the real runtime) deploy on their own running clusters with these."""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

from deployments.store import downloads
from deployments.choices import CopyState
from deployments.models import Copy, Deployment
from lab import hub_models
from machines.agent_client import Agent

TINY = "fadenstack-lab/tiny-chat"
KIND = "nvidia|H100 80GB|81559|x86_64"  # the lab's machines' GPUs, as the Deploy form names the kind


def tiny_model():
    store = hub_models.ModelStore(hub_models.default_cache_dir())
    plan = hub_models.MODELS[TINY]
    store.files(plan)  # generated once per host, then cached
    return downloads.model_import(directory=store.model_dir(plan) / "files", repo=TINY)


def call(url: str, key: str, body: dict, timeout: float = 30) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def chat(console, key: str, *, stream: bool = False, model: str = "tiny") -> tuple[int, bytes]:
    return call(f"{console.gateway_url}/v1/chat/completions", key,
                {"model": model, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 8, "stream": stream})


def serving(count: int, name: str = "tiny"):
    return lambda: (Deployment.objects.filter(name=name).first() is not None and
                    Copy.objects.filter(deployment__name=name, state=CopyState.SERVING).count() == count
                    and Copy.objects.filter(deployment__name=name).count() == count)


class Caller(threading.Thread):
    """Calls the gateway over and over until stopped; every answer's status is kept."""

    def __init__(self, console, key: str, model: str = "tiny"):
        super().__init__(daemon=True)
        self.console, self.key, self.model, self.statuses, self.halt = console, key, model, [], threading.Event()

    stream = False  # StreamCaller: each answer streamed, and one cut short (no final [DONE]) counts as failed

    def run(self):
        while not self.halt.is_set():
            status, body = chat(self.console, self.key, model=self.model, stream=self.stream)
            if self.stream and status == 200 and not body.rstrip().endswith(b"data: [DONE]"):
                status = -1  # a stream cut short
            self.statuses.append(status)
            time.sleep(0.05)

    def stop(self) -> list[int]:
        self.halt.set()
        self.join(timeout=60)
        return self.statuses


class StreamCaller(Caller):
    """A Caller whose every answer is streamed; a stream cut short is kept as status -1."""

    stream = True


def copies_cleared(machines) -> None:
    """No copy and no model left in the machines' stores (machines a failed test left off are skipped)."""
    for machine in machines:
        try:
            with Agent.open(machine) as agent:
                for status in agent.copy_list():
                    agent.copy_stop(status.copy)
                for placed in agent.model_list().models:
                    agent.model_remove(repo=placed.repo, revision=placed.revision)
        except Exception:  # noqa: BLE001 (a machine a failed test left off: heal() brought it back or will)
            pass
