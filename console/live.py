"""Live cards: one registry of topics, one push helper, one consumer (consumers.py).

A topic names what a page shows live: ``machines`` (the list) or
``machine:12`` (one machine). Each app registers a renderer for its topics
that returns the HTML of every live card of that topic, each with its id and
``hx-swap-oob``, so the same fragments serve the websocket's first render on
connect and every push after a change. A renderer returns a list of messages:
table rows go in messages of their own, since an HTML parser drops a ``<tr>``
that follows a ``<div>``. Pushes are hints; the database is the
truth: a page that reloads shows the same thing.

A card is rendered for a role (console/roles.py): its buttons are greyed out, with the reason,
for a role that may not press them. So a topic has one group per role, and a push renders once
for each role that watches it, not once per socket.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from django.db import connection, transaction

from console import params, pubsub, roles

log = logging.getLogger(__name__)

# (topic argument, part, role of those who watch) -> the websocket messages (HTML) of the topic's
# live cards; part "" means all of them, another part (a row's id, say) lets a push send only what changed.
Renderer = Callable[[str, str, roles.Role], list[str]]
Checker = Callable[[object, str], bool]  # (user, topic argument) -> may this user see it, beyond having a role
ArgRule = Callable[[str], bool]  # topic argument -> is it one this kind of topic takes


@dataclass(frozen=True)
class TopicKind:
    renderer: Renderer
    may_see: Checker
    takes: ArgRule


_kinds: dict[str, TopicKind] = {}
_TOPIC = re.compile(r"([a-z][a-z-]{0,31})(?::([0-9a-z-]{1,64}))?")


def no_arg(arg: str) -> bool:
    """A topic of one thing only: ``clusters``."""
    return arg == ""


def an_id(arg: str) -> bool:
    """A topic of one object: ``machine:12``, its id within the database's range and written as pushes
    write it (``machine:012`` would subscribe to a group no push reaches)."""
    try:
        return str(params.parse_int(arg, name="topic")) == arg
    except params.InvalidParameter:
        return False


def one_of(*args: str) -> ArgRule:
    """A topic with a few named views: ``one_of("", "summary")`` for ``machines`` and ``machines:summary``."""
    return lambda arg: arg in args


def _anyone(user, arg: str) -> bool:
    return True


def register(kind: str, renderer: Renderer, *, may_see: Checker | None = None, takes: ArgRule = no_arg) -> None:
    """Register the renderer of a topic kind (``machine`` for ``machine:12``) and the arguments it
    takes (``an_id``): a topic whose argument the kind does not take is refused before anything
    subscribes to it or renders it. Every role may watch every topic; ``may_see`` narrows it further."""
    _kinds[kind] = TopicKind(renderer=renderer, may_see=may_see or _anyone, takes=takes)


def parse_topic(topic: str) -> tuple[str, str] | None:
    """``(kind, argument)`` of a topic some app registered with an argument it takes, else None."""
    match = _TOPIC.fullmatch(topic)
    if not match or match.group(1) not in _kinds:
        return None
    kind, arg = match.group(1), match.group(2) or ""
    return (kind, arg) if _kinds[kind].takes(arg) else None


def group_name(topic: str, role: roles.Role) -> str:
    """The group of those who watch ``topic`` with ``role``: ``live.machine.12.viewer``."""
    return f"live.{topic.replace(':', '.')}.{role.slug}"


def render_topic(topic: str, part: str, role: roles.Role) -> list[str]:
    kind, arg = parse_topic(topic)
    return _kinds[kind].renderer(arg, part, role)


def may_see(user, topic: str) -> bool:
    """Anyone with a role, for a topic that exists (and whose own check, if any, agrees)."""
    parsed = parse_topic(topic)
    return bool(parsed) and roles.role_of(user) is not None and _kinds[parsed[0]].may_see(user, parsed[1])


def push(topic: str, part: str = "") -> None:
    """Send a fresh render of the topic (or of one part of it) to its groups once the transaction commits.

    Several pushes of the same thing in one transaction are sent once. Nothing is rendered for a
    role while nobody with it has the topic open: a page that opens renders its cards when its
    websocket connects.
    """
    key = (topic, part)
    # Callbacks waiting for this transaction's commit (Django drops them on rollback).
    if any(getattr(callback, "live_key", None) == key for _, callback, *_ in connection.run_on_commit):
        return

    def send() -> None:
        try:
            for role in roles.ROLES:
                group = group_name(topic, role)
                if not pubsub.watched(group):
                    continue
                for html in render_topic(topic, part, role):
                    if html.strip():
                        pubsub.send(group, {"type": "live.html", "html": html})
        except Exception:  # noqa: BLE001 - a lost hint is recovered by the next render
            log.exception("could not push %s %s", topic, part)

    send.live_key = key
    transaction.on_commit(send)
