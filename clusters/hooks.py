"""Where apps above clusters (deployments) plug in, so that clusters never imports them.

- Signals, sent inside the transaction of the change (receivers that enqueue
  work do it on commit): ``cluster_running`` (a start or restart ended with the
  cluster Running), ``cluster_stopping`` (a stop or a delete begins),
  ``member_leaving`` (a machine leaves the cluster's record), ``members_joined``
  (machines joined the cluster's Ray or came back to it: room for copies).
- ``ClusterExtension``: what the cluster asks of an app that runs things on its
  machines (deployments: copies of models), each question a method. An app
  implements it in one class and registers one instance (``extension_register``);
  the functions below ask every registered extension and put the answers together.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Protocol, runtime_checkable

from django.dispatch import Signal

# cluster (the Cluster row); sent when a start ends with the cluster Running.
cluster_running = Signal()
# cluster, deleting (bool); sent when a stop or a delete is written.
cluster_stopping = Signal()
# cluster, machine_id; sent before a machine leaves the cluster's record.
member_leaving = Signal()
# cluster_id, machine_ids; sent when members become Up (they joined, or came back), in the same transaction.
members_joined = Signal()


@dataclass(frozen=True)
class PageCard:
    name: str  # also the part of the cluster's page topic that renders the card alone
    template: str  # rendered with the cluster's page context plus what ``context`` returns
    context: Callable[[object, object], dict]  # (cluster, the viewer's role) -> context


@runtime_checkable
class ClusterExtension(Protocol):
    """What the cluster asks of an app that runs things on its machines."""

    # The key of the health question's answer in each machine's answers (``after_check`` reads it there).
    name: str

    def delete_refusal(self, cluster) -> str | None:
        """Why the cluster cannot be deleted now (deployments still on it), in words; None when it can."""

    def accelerators_held(self, cluster, machine_ids: list[int]) -> Fraction:
        """The accelerators held on those machines of the cluster (a share of a GPU counts as its share)."""

    def gpus_held(self, cluster) -> dict[int, set[int]]:
        """The GPU indices held on each of the cluster's machines, by machine id (a person's own jobs get the rest)."""

    def serving_copies(self, cluster) -> int:
        """How many copies of models serve on the cluster's GPUs now (the NCCL test, which takes every GPU,
        asks for confirmation first)."""

    def health_question(self, agent, member) -> object:
        """Asked in the health check's own SSH session with the member's agent; None means nothing to ask."""

    def after_check(self, cluster, answers: dict[int, dict]) -> None:
        """Runs after each recorded check with every member's answers, so that the app looks at its own parts."""

    def page_cards(self) -> list[PageCard]:
        """Cards on the cluster's page, drawn after the cluster's own, in this order."""


_extensions: dict[str, ClusterExtension] = {}


def extension_register(extension: ClusterExtension) -> None:
    """Register the app's extension (once, from its AppConfig.ready; again under the same name replaces it)."""
    _extensions[extension.name] = extension


def extensions() -> list[ClusterExtension]:
    return list(_extensions.values())


def delete_refusal(cluster) -> str | None:
    """Every reason that refuses deleting the cluster now, in words; None when nothing does."""
    reasons = [why for extension in _extensions.values() if (why := extension.delete_refusal(cluster))]
    return " ".join(reasons) or None


def accelerators_free(cluster, joined: list) -> float:
    """Free accelerators: those of the machines that are up, less what is held on them."""
    total = sum(m.accelerators_in_ray for m in joined)
    machine_ids = [m.machine_id for m in joined]
    held = sum(e.accelerators_held(cluster, machine_ids) for e in _extensions.values()) if machine_ids else 0
    free = max(total - held, 0)
    return int(free) if free == int(free) else round(float(free), 2)


def serving_copies(cluster) -> int:
    """Every copy that serves on the cluster, whatever app runs it."""
    return sum(extension.serving_copies(cluster) for extension in _extensions.values())


def after_check(cluster, answers: dict[int, dict]) -> None:
    for extension in _extensions.values():
        extension.after_check(cluster, answers)


def extension_cards() -> list[PageCard]:
    return [card for extension in _extensions.values() for card in extension.page_cards()]


def held_out_of_ray(cluster) -> set[int]:
    """The machines of the cluster an app drained (deployments: a machine's drain), by id: Ray lets a drained node
    go, and a health check must not join it again. An extension without ``held_out_of_ray`` holds none."""
    held: set[int] = set()
    for extension in _extensions.values():
        ask = getattr(extension, "held_out_of_ray", None)
        if ask is not None:
            held |= set(ask(cluster))
    return held


def machine_notes(cluster) -> dict[int, dict]:
    """What an app says of each machine of the cluster beside its state (deployments: its drain: ``label``,
    ``badge``, ``reason``, and whether ``stop`` or ``cancel`` applies), by machine id. An extension without
    ``machine_notes`` says nothing."""
    notes: dict[int, dict] = {}
    for extension in _extensions.values():
        ask = getattr(extension, "machine_notes", None)
        if ask is not None:
            notes.update(ask(cluster))
    return notes


def gpus_held(cluster) -> dict[int, set[int]]:
    """Every GPU index held on each machine of the cluster, whatever app holds it, by machine id: what a
    person's own jobs may use is the rest."""
    held: dict[int, set[int]] = {}
    for extension in _extensions.values():
        for machine_id, indices in extension.gpus_held(cluster).items():
            held.setdefault(machine_id, set()).update(indices)
    return held
