"""Cards other apps add to a machine's page (deployments: the models its store holds), without
machines importing them: each registers a template and a function giving its context."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class MachineCard:
    name: str
    template: str
    context: Callable[..., dict]  # (machine) -> context, or (machine, role) when takes_role
    takes_role: bool = False  # its buttons are drawn for the viewer's role


_cards: dict[str, MachineCard] = {}


def machine_card_register(name: str, *, template: str, context: Callable[..., dict], takes_role: bool = False) -> None:
    _cards[name] = MachineCard(name=name, template=template, context=context, takes_role=takes_role)


def machine_cards_extra(machine, role=None) -> dict:
    """The registered cards' templates (``extra_cards``) with their context merged in."""
    context: dict = {"extra_cards": []}
    for card in _cards.values():
        context |= card.context(machine, role) if card.takes_role else card.context(machine)
        context["extra_cards"].append(card.template)
    return context
