"""The one guard every state change goes through, for any model with a lifecycle table.

A model with a lifecycle has ``state``, ``state_reason`` and ``state_changed_at``
fields, and its app keeps the table of allowed moves beside its choices.
"""
from collections.abc import Callable, Mapping

from django.db import models
from django.utils import timezone


class InvalidTransition(Exception):
    pass


def sources_of(allowed: Mapping[str, frozenset[str]], to: str) -> list[str]:
    """The states the table lets a row leave for ``to`` (itself included: that only refreshes the reason): the
    state filter of a guarded UPDATE, which then never writes a move the table forbids."""
    return [state for state, targets in allowed.items() if to in targets or state == to]


def transition(
    obj: models.Model,
    *,
    to: str,
    allowed: Mapping[str, frozenset[str]],
    reason: str = "",
    on_change: Callable[[], None],
) -> bool:
    """Move ``obj`` to ``to`` if the table allows it, save it, and tell ``on_change``.

    Returns False when it already is in that state (only the reason is refreshed).
    """
    if obj.state == to:
        if reason != obj.state_reason:
            obj.state_reason = reason
            obj.save(update_fields=["state_reason"])
            on_change()
        return False
    if to not in allowed[obj.state]:
        label = dict(obj._meta.get_field("state").choices)[to]
        raise InvalidTransition(f"{obj} cannot go from {obj.get_state_display()} to {label}.")
    obj.state = to
    obj.state_reason = reason
    obj.state_changed_at = timezone.now()
    obj.save(update_fields=["state", "state_reason", "state_changed_at"])
    on_change()
    return True
