"""The dashboard's panels: each app registers what it shows there, so console imports no app.

A panel is a template, a function that gives it its context, and the live
topics whose pushes keep it fresh. The dashboard renders the panels in order
and subscribes to their topics only: a topic's renderer must then send nothing
that has no target on the dashboard (htmx logs ``oobErrorNoTarget`` for it).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from django.http import HttpRequest


@dataclass(frozen=True)
class Panel:
    name: str  # unique: registering a name again replaces the panel
    template: str  # "app/_panel.html" or a partial, "app/page.html#name"
    context: Callable[[HttpRequest], dict]
    topics: tuple[str, ...] = ()  # live topics the panel's cards come back on (``machines:summary``)
    order: int = 100  # lower first
    wide: bool = False  # across the whole page instead of one of two columns


_panels: dict[str, Panel] = {}


def register(panel: Panel) -> None:
    """Show a panel on the dashboard; call it from the app's ``AppConfig.ready``."""
    _panels[panel.name] = panel


def panels() -> list[Panel]:
    return sorted(_panels.values(), key=lambda panel: (panel.order, panel.name))


def live_topics(shown: list[Panel]) -> str:
    """The websocket's query string for these panels (``topic=a&topic=b``), each topic once."""
    topics = dict.fromkeys(topic for panel in shown for topic in panel.topics)
    return "&".join(f"topic={topic}" for topic in topics)
