"""Cards other apps add to a machine's page (deployments: the models its store holds), without
machines importing them: each registers a template and a function giving its context."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class MachineCard:
    name: str
    template: str
    context: Callable[[object], dict]  # (machine) -> context


_cards: dict[str, MachineCard] = {}


def machine_card_register(name: str, *, template: str, context: Callable[[object], dict]) -> None:
    _cards[name] = MachineCard(name=name, template=template, context=context)


def machine_cards_extra(machine) -> dict:
    """The registered cards' templates (``extra_cards``) with their context merged in."""
    context: dict = {"extra_cards": []}
    for card in _cards.values():
        context |= card.context(machine)
        context["extra_cards"].append(card.template)
    return context
