"""Where apps above clusters (deployments) plug in, so that clusters never imports them.

- Signals, sent inside the transaction of the change (receivers that enqueue
  work do it on commit): ``cluster_running`` (a start or restart ended with the
  cluster Running), ``cluster_stopping`` (a stop or a delete begins),
  ``member_leaving`` (a machine leaves the cluster's record), ``members_joined``
  (machines joined the cluster's Ray or came back to it: room for copies).
- ``page_card_register``: a card on the cluster's page (a template and a
  function giving its context), drawn in the order registered.
- ``delete_blocker_register``: a check that refuses Delete with a sentence
  (deployments that still run on the cluster, say).
- ``health_extension_register``: called after each health check with what was
  looked at, so that an app can look at its own parts (copies of models).
- ``health_question_register``: one more question each machine's agent is asked in
  the check's own SSH session (the copies it runs, say); its answer goes into the
  answers the health extensions get, under the question's name.
- ``accelerators_held_register``: how many of a cluster's accelerators are held
  (by copies of models), so that Free accelerators counts them.
- ``serving_copies_register``: how many copies serve on a cluster's GPUs, so that
  the NCCL test (which takes every GPU) asks for confirmation first.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    name: str
    template: str  # rendered with the cluster's page context plus what ``context`` returns
    context: Callable[[object, object], dict]  # (cluster, the viewer's role) -> context


_cards: dict[str, PageCard] = {}
_delete_blockers: dict[str, Callable[[object], str | None]] = {}
_health_extensions: dict[str, Callable[[object, dict], None]] = {}
_accelerators_held: dict[str, Callable[[object, list[int]], float]] = {}
_health_questions: dict[str, Callable[[object, object], object]] = {}
_serving_copies: dict[str, Callable[[object], int]] = {}


def page_card_register(name: str, *, template: str, context: Callable[[object], dict]) -> None:
    _cards[name] = PageCard(name=name, template=template, context=context)


def page_cards() -> list[PageCard]:
    return list(_cards.values())


def page_card(name: str) -> PageCard | None:
    """The card registered under ``name``: a live push of the cluster's page for that part renders it alone."""
    return _cards.get(name)


def delete_blocker_register(name: str, check: Callable[[object], str | None]) -> None:
    """``check(cluster)`` returns why the cluster cannot be deleted now, or None."""
    _delete_blockers[name] = check


def delete_blockers(cluster) -> list[str]:
    """Every reason that refuses deleting the cluster now, in words."""
    return [why for check in _delete_blockers.values() if (why := check(cluster))]


def health_extension_register(name: str, extension: Callable[[object, dict], None]) -> None:
    """``extension(cluster, answers)`` runs after each recorded check; answers are each machine's agent's."""
    _health_extensions[name] = extension


def health_question_register(name: str, ask: Callable[[object, object], object]) -> None:
    """``ask(agent, member)`` runs in the check's session with the member's agent; None means nothing to ask."""
    _health_questions[name] = ask


def health_questions() -> dict[str, Callable[[object, object], object]]:
    return dict(_health_questions)


def health_extensions_run(cluster, answers: dict) -> None:
    for extension in _health_extensions.values():
        extension(cluster, answers)


def accelerators_held_register(name: str, held: Callable[[object, list[int]], float]) -> None:
    """``held(cluster, machine_ids)``: the accelerators held on those machines of the cluster (a share of
    a GPU counts as its share)."""
    _accelerators_held[name] = held


def accelerators_free(cluster, joined: list) -> float:
    """Free accelerators: those of the machines that are up, less what is held on them."""
    total = sum(m.accelerators_in_ray for m in joined)
    machine_ids = [m.machine_id for m in joined]
    held = sum(held(cluster, machine_ids) for held in _accelerators_held.values()) if machine_ids else 0
    free = max(total - held, 0)
    return int(free) if free == int(free) else round(float(free), 2)


def serving_copies_register(name: str, count: Callable[[object], int]) -> None:
    """``count(cluster)``: how many copies of models serve on the cluster's machines now."""
    _serving_copies[name] = count


def serving_copies(cluster) -> int:
    """Every copy that serves on the cluster, whatever app runs it."""
    return sum(count(cluster) for count in _serving_copies.values())
