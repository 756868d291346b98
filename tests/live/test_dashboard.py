"""The dashboard: panels the apps register, and a socket that sends only what the page has a place for.

htmx's ws extension swaps every top-level element of a message out of band, by its id (or the
selector of ``hx-swap-oob="beforeend:#id"``); one whose target is not on the page only logs
``htmx:oobErrorNoTarget`` in the browser.
"""
from html.parser import HTMLParser
from urllib.parse import parse_qs

import pytest
from django.db import transaction

from console import dashboard, live, pubsub, roles
from machines import services
from machines.choices import EventKind, MachineState
from tests.factories import JobFactory, MachineFactory

pytestmark = pytest.mark.django_db

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


class Elements(HTMLParser):
    """Every id in a document, and the out-of-band target of each top-level element of a fragment."""

    def __init__(self, html: str):
        super().__init__()
        self.ids: set[str] = set()
        self.targets: list[str] = []
        self.depth = 0
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if self.depth == 0:
            swap = attrs.get("hx-swap-oob") or "true"
            selector = swap.partition(":")[2]
            self.targets.append(selector.removeprefix("#") if selector else attrs.get("id", f"<{tag}> without an id"))
        if tag not in VOID:
            self.depth += 1

    def handle_endtag(self, tag):
        if tag not in VOID:
            self.depth -= 1


def dashboard_topics(response) -> list[str]:
    return parse_qs(response.context["live_topics"])["topic"]


def assert_every_target_on_the_page(messages: list[str], page_ids: set[str]) -> None:
    for html in messages:
        for target in Elements(html).targets:
            assert target in page_ids, f"the dashboard has no #{target} for {html[:120]!r}"


@pytest.fixture
def machines_with_history():
    machines = MachineFactory.create_batch(3)
    services.machine_event(machine=machines[0], kind=EventKind.RECONNECTED, message="Reconnected after 2 minutes without a heartbeat.")
    JobFactory(title="Enrol gpu-000")
    return machines


def test_the_dashboard_shows_the_panels_the_apps_registered(admin_client, machines_with_history):
    page = admin_client.get("/").content.decode()

    assert 'id="machine-summary"' in page
    assert "Reconnected after 2 minutes" in page
    assert "Enrol gpu-000" in page
    assert page.index('data-panel="machine-summary"') < page.index('data-panel="machine-events"') < page.index('data-panel="recent-jobs"')


def test_the_dashboard_subscribes_to_the_machines_summary_and_not_to_their_list(admin_client):
    assert dashboard_topics(admin_client.get("/")) == [services.SUMMARY_TOPIC]


def test_the_dashboards_topics_render_on_connect_only_fragments_whose_targets_are_on_the_page(admin_client, machines_with_history):
    response = admin_client.get("/")
    page_ids = Elements(response.content.decode()).ids

    messages = [html for topic in dashboard_topics(response) for html in live.render_topic(topic, "", roles.ADMINISTRATOR)]

    assert messages
    assert_every_target_on_the_page(messages, page_ids)


# Committed for real: the test's own transaction would hold every push until its end, as one.
@pytest.mark.django_db(transaction=True)
def test_what_the_dashboards_topics_are_pushed_when_machines_change_has_a_target_on_the_page(
    admin_client, machines_with_history, monkeypatch
):
    response = admin_client.get("/")
    page_ids = Elements(response.content.decode()).ids
    groups = {live.group_name(topic, roles.ADMINISTRATOR) for topic in dashboard_topics(response)}
    sent = []
    monkeypatch.setattr(pubsub, "watched", lambda group: True)  # as if a page had every topic open
    monkeypatch.setattr(pubsub, "send", lambda group, message: sent.append((group, message["html"])))
    first, second, third = machines_with_history

    with transaction.atomic():
        services.machine_transition(machine=first, to=MachineState.OFFLINE, reason="No heartbeat for 31 s.")
    with transaction.atomic():
        services.machine_facts_apply(machine=second, facts={"accelerators": [{"index": 0, "model": "H100"}]})
    services.machine_delete(machine=third)

    to_the_dashboard = [html for group, html in sent if group in groups]
    assert len(to_the_dashboard) == 3  # one summary per change; the list's rows go to the list's group only
    assert_every_target_on_the_page(to_the_dashboard, page_ids)
    assert 'Accelerators</span><span class="stat__value">1<' in to_the_dashboard[1]


def test_a_panel_registered_by_an_app_is_shown_and_its_topics_subscribed_once(admin_client, monkeypatch):
    panel = dashboard.Panel(
        name="test-panel", template="machines/_recent_events.html", context=lambda request: {"events": []},
        topics=(services.SUMMARY_TOPIC, "clusters"), order=15,
    )
    monkeypatch.setitem(dashboard._panels, panel.name, panel)

    response = admin_client.get("/")

    assert 'data-panel="test-panel"' in response.content.decode()
    assert dashboard_topics(response) == [services.SUMMARY_TOPIC, "clusters"]
