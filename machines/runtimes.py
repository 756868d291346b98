"""Which container runtime a machine runs its clusters' containers with, and the sentence when it has none.

Pure: plain data in, plain data out, so the cluster planner (clusters/planning.py) may use it too.

The agent's facts name the engines it found (``container_runtimes``: Docker and Podman, with their
versions) and the one it would use by itself (``container_runtime``): the driver the machine's
agent config names when one is set (the lab's ``process``), else Docker when its daemon answers,
else Podman. An administrator may choose between the engines found (``Machine.runtime_choice``).
The runtime in use is then, in this order:

1. the driver the machine's config names: the agent uses it whatever the console asks;
2. the administrator's choice, when the machine has that engine;
3. Docker when the machine has it (alone or beside Podman);
4. Podman;
5. none: the machine cannot be picked for a cluster (``no_runtime``).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

DOCKER, PODMAN = "docker", "podman"
ENGINES = (DOCKER, PODMAN)  # what the agent looks for, in the order it prefers them
LABELS = {DOCKER: "Docker", PODMAN: "Podman", "process": "Process"}

# The one sentence for a machine without a runtime: the machine's page, the wizard, Add machines,
# the services and the API all say it (the agent says the same of "this machine").
NO_RUNTIME = "No container runtime on {name}: install Docker or Podman"


def no_runtime(name: str) -> str:
    return NO_RUNTIME.format(name=name)


def label(name: str) -> str:
    """``Docker``, ``Podman``, ``Process``; another driver's name as the agent wrote it."""
    return LABELS.get(name, name)


@dataclass(frozen=True)
class Runtime:
    name: str
    version: str = ""

    @property
    def label(self) -> str:
        return label(self.name)

    def as_dict(self) -> dict:
        return {"name": self.name, "version": self.version}


def _runtime(entry) -> Runtime | None:
    if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str) or not entry["name"]:
        return None
    version = entry.get("version")
    return Runtime(name=entry["name"][:64], version=str(version)[:64] if version is not None else "")


def found_in(facts: Mapping) -> list[Runtime]:
    """The engines the agent found answering, once each, in the agent's order of preference. An agent older than
    ``container_runtimes`` named only the one it would use: that one, when it is an engine."""
    listed = facts.get("container_runtimes")
    if isinstance(listed, list):
        # An engine whose daemon does not answer (Docker's client without its daemon) runs nothing.
        entries = [_runtime(e) for e in listed if not (isinstance(e, Mapping) and e.get("answers") is False)]
    else:
        entries = [_runtime(facts.get("container_runtime"))]
    engines = {e.name: e for e in reversed(entries) if e is not None and e.name in ENGINES}  # the first of a name wins
    return [engines[name] for name in ENGINES if name in engines]


def configured_in(facts: Mapping) -> Runtime | None:
    """The driver the machine's agent config names, when it names one: the runtime the agent reports
    that is no engine it found (the lab's ``process``, or an engine it did not find), or that it says
    is configured."""
    named = _runtime(facts.get("container_runtime"))
    if named is None:
        return None
    found = {r.name for r in found_in(facts)}
    configured = facts["container_runtime"].get("configured") is True
    return named if configured or named.name not in found else None


def in_use(*, configured: Runtime | None, found: Sequence[Runtime], choice: str) -> Runtime | None:
    """The runtime the machine's containers run with (the module's docstring says the order)."""
    if configured is not None:
        return configured
    by_name = {r.name: r for r in found}
    for name in (choice, *ENGINES):
        if name in by_name:
            return by_name[name]
    return None


def choice_refusal(*, machine_name: str, choice: str, found: Iterable[Runtime]) -> str:
    """Why the administrator may not choose ``choice`` for this machine; empty when they may.
    Automatic ("") is always allowed; an engine only when the agent found it there."""
    if not choice:
        return ""
    if choice not in ENGINES:
        return f"Choose {' or '.join(label(e) for e in ENGINES)}, or automatic: {choice[:30]!r} is not a container runtime."
    found = list(found)
    if any(r.name == choice for r in found):
        return ""
    has = " and ".join(r.label for r in found)
    instead = f"it has {has}" if has else "it has no container runtime"
    return f"{machine_name} has no {label(choice)}: {instead}. Install {label(choice)} there and select Refresh facts first."
