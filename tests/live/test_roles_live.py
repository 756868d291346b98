"""Live cards for each role: an account without one opens no topic, and every role gets the cards
rendered for it, on connect and after a change, one render per role that watches."""
import dataclasses
import re

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import transaction
from django.test import Client

from console import live, pubsub, roles
from console.roles import ADMINISTRATOR, OPERATOR, VIEWER
from machines import services
from machines.choices import MachineState
from tests.factories import NO_ROLE, MachineFactory, UserFactory
from tests.live.test_websocket import WAIT, socket

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("isolated_channel_layer")]


def cookie_of(role) -> str:
    client = Client()
    client.force_login(UserFactory(role=role))
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


def refresh_button(html: str) -> str:
    match = re.search(r'(?:<span class="btn-wrap"[^>]*>\s*)?<button[^>]*>Refresh facts</button>', html)
    assert match, html
    return match.group(0)


def test_an_account_without_a_role_opens_no_topic():
    machine, cookie = MachineFactory(), cookie_of(NO_ROLE)

    async def scenario():
        ws = socket(f"topic=machine:{machine.pk}", cookie=cookie)
        connected, code = await ws.connect()
        await ws.disconnect()
        return connected, code

    assert async_to_sync(scenario)() == (False, 4403)


def test_each_role_gets_the_cards_rendered_for_it_on_connect_and_after_a_change():
    machine = MachineFactory(state=MachineState.HEALTHY)
    cookies = {role: cookie_of(role) for role in (VIEWER, OPERATOR)}

    async def scenario():
        sockets = {role: socket(f"topic=machine:{machine.pk}", cookie=cookie) for role, cookie in cookies.items()}
        seen = {}
        for role, ws in sockets.items():
            assert (await ws.connect())[0]
            seen[role] = [await ws.receive_from(timeout=WAIT)]

        def change():
            with transaction.atomic():
                services.machine_transition(machine=machine, to=MachineState.OFFLINE, reason="No heartbeat for 31 s.")

        await database_sync_to_async(change)()
        for role, ws in sockets.items():
            seen[role].append(await ws.receive_from(timeout=WAIT))
            await ws.disconnect()
        return seen

    seen = async_to_sync(scenario)()

    for on_connect_or_pushed in seen[VIEWER]:
        assert "disabled" in refresh_button(on_connect_or_pushed)
        assert "Your role is Viewer: refreshing a machine&#x27;s facts needs an Operator." in on_connect_or_pushed
    for on_connect_or_pushed in seen[OPERATOR]:
        assert "disabled" not in refresh_button(on_connect_or_pushed)
    assert ">Offline</span>" in seen[VIEWER][1] and ">Offline</span>" in seen[OPERATOR][1]


@pytest.mark.django_db
def test_a_push_renders_once_for_each_role_that_watches_and_not_for_the_others(monkeypatch, django_capture_on_commit_callbacks):
    machine = MachineFactory()
    watched = {live.group_name(f"machine:{machine.pk}", role) for role in (VIEWER, ADMINISTRATOR)}
    kind = live._kinds["machine"]
    rendered_for, sent_to = [], []
    monkeypatch.setitem(live._kinds, "machine", dataclasses.replace(
        kind, renderer=lambda arg, part, role: rendered_for.append(role) or kind.renderer(arg, part, role)))
    monkeypatch.setattr(pubsub, "watched", lambda group: group in watched)
    monkeypatch.setattr(pubsub, "send", lambda group, message: sent_to.append(group))

    with django_capture_on_commit_callbacks(execute=True):
        live.push(f"machine:{machine.pk}")

    assert rendered_for == [VIEWER, ADMINISTRATOR]
    assert set(sent_to) == watched


def test_every_role_may_watch_every_topic_and_no_role_none():
    machine = MachineFactory()
    topics = ["machines", "machines:summary", f"machine:{machine.pk}", "clusters", "cluster:1", "probe:1"]

    for role in roles.ROLES:
        user = UserFactory(role=role)
        assert all(live.may_see(user, topic) for topic in topics), role
    assert not any(live.may_see(UserFactory(role=NO_ROLE), topic) for topic in topics)
    assert not live.may_see(UserFactory(role=VIEWER, is_active=False), "machines")
