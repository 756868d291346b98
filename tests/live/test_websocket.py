"""The live websocket: who may open it, what it sends on connect, and what it pushes after a commit."""
import dataclasses

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.db import transaction
from django.test import Client

from config.asgi import application
from machines import services
from machines.choices import MachineState
from tests.factories import MachineFactory, UserFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("isolated_channel_layer")]

WAIT = 3  # seconds a push may take through Redis


def session_cookie() -> str:
    client = Client()
    client.force_login(UserFactory())
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


def socket(topics: str, *, cookie: str = "", origin: str = "http://testserver") -> WebsocketCommunicator:
    headers = [(b"host", b"testserver"), (b"origin", origin.encode())]
    if cookie:
        headers.append((b"cookie", cookie.encode()))
    return WebsocketCommunicator(application, f"/ws/live/?{topics}", headers=headers)


def in_a_transaction(work):
    """Run ``work`` in one committed transaction, from the async side."""

    def run():
        with transaction.atomic():
            work()

    return database_sync_to_async(run)()


def test_an_anonymous_connection_is_refused():
    machine = MachineFactory()

    async def scenario():
        ws = socket(f"topic=machine:{machine.pk}")
        connected, code = await ws.connect(timeout=WAIT)
        await ws.disconnect()
        return connected, code

    assert async_to_sync(scenario)() == (False, 4401)


def test_a_connection_from_a_page_of_another_origin_is_refused_even_when_signed_in():
    machine, cookie = MachineFactory(), session_cookie()

    async def scenario():
        results = []
        for origin in ("https://evil.example", "http://testserver.evil.example", ""):
            ws = socket(f"topic=machine:{machine.pk}", cookie=cookie, origin=origin)
            results.append(await ws.connect())
            await ws.disconnect()
        return results

    assert async_to_sync(scenario)() == [(False, 4403)] * 3


def test_a_connection_without_a_topic_it_knows_is_refused():
    cookie = session_cookie()

    async def scenario():
        ws = socket("topic=secrets", cookie=cookie)
        connected, code = await ws.connect(timeout=WAIT)
        await ws.disconnect()
        return connected, code

    assert async_to_sync(scenario)() == (False, 4403)


def test_a_signed_in_user_gets_the_machines_cards_on_connect_and_a_fresh_render_after_a_change():
    machine, cookie = MachineFactory(state=MachineState.HEALTHY), session_cookie()

    async def scenario():
        ws = socket(f"topic=machine:{machine.pk}", cookie=cookie)
        connected, _ = await ws.connect(timeout=WAIT)
        assert connected
        on_connect = await ws.receive_from(timeout=WAIT)
        await in_a_transaction(
            lambda: services.machine_transition(machine=machine, to=MachineState.OFFLINE, reason="No heartbeat for 31 s.")
        )
        pushed = await ws.receive_from(timeout=WAIT)
        await ws.disconnect()
        return on_connect, pushed

    on_connect, pushed = async_to_sync(scenario)()

    assert 'id="machine-header"' in on_connect
    assert 'hx-swap-oob="true"' in on_connect
    assert ">Healthy</span>" in on_connect
    assert 'id="machine-header"' in pushed
    assert ">Offline</span>" in pushed
    assert "No heartbeat for 31 s." in pushed


def test_nothing_is_pushed_for_a_transaction_that_rolls_back():
    machine, cookie = MachineFactory(state=MachineState.HEALTHY), session_cookie()

    def change_then_roll_back():
        services.machine_transition(machine=machine, to=MachineState.OFFLINE)
        raise RuntimeError("rolled back")

    async def scenario():
        ws = socket(f"topic=machine:{machine.pk}", cookie=cookie)
        await ws.connect(timeout=WAIT)
        await ws.receive_from(timeout=WAIT)
        with pytest.raises(RuntimeError):
            await in_a_transaction(change_then_roll_back)
        nothing = await ws.receive_nothing(timeout=0.5)
        await ws.disconnect()
        return nothing

    assert async_to_sync(scenario)() is True


def test_several_pushes_of_the_same_topic_in_one_transaction_are_sent_once():
    machine, cookie = MachineFactory(state=MachineState.HEALTHY), session_cookie()

    def flap():
        services.machine_transition(machine=machine, to=MachineState.OFFLINE, reason="No heartbeat for 31 s.")
        services.machine_transition(machine=machine, to=MachineState.HEALTHY)
        services.machine_transition(machine=machine, to=MachineState.FAILED, reason="The host key changed.")

    async def scenario():
        ws = socket(f"topic=machine:{machine.pk}", cookie=cookie)
        await ws.connect(timeout=WAIT)
        await ws.receive_from(timeout=WAIT)
        await in_a_transaction(flap)
        pushed = [await ws.receive_from(timeout=WAIT)]
        while not await ws.receive_nothing(timeout=0.5):
            pushed.append(await ws.receive_from(timeout=WAIT))
        await ws.disconnect()
        return pushed

    pushed = async_to_sync(scenario)()

    assert len(pushed) == 1
    assert ">Failed</span>" in pushed[0]  # rendered at commit: the last state, not the first


def test_the_machines_list_gets_a_new_row_when_a_machine_is_added(monkeypatch):
    from machines import remote
    from tests.factories import fingerprint_for

    monkeypatch.setattr(remote, "scan_host_key", lambda address, port: fingerprint_for("new machine"))
    MachineFactory(name="gpu-already-there")
    cookie = session_cookie()

    async def scenario():
        ws = socket("topic=machines", cookie=cookie)
        connected, _ = await ws.connect(timeout=WAIT)
        assert connected
        # The summary and the rows come as two messages: an HTML parser drops rows after a <div>.
        on_connect = await ws.receive_from(timeout=WAIT) + await ws.receive_from(timeout=WAIT)
        await database_sync_to_async(services.machine_create)(name="gpu-new", address="198.18.9.9")
        pushed = await ws.receive_from(timeout=WAIT) + await ws.receive_from(timeout=WAIT)
        await ws.disconnect()
        return on_connect, pushed

    on_connect, pushed = async_to_sync(scenario)()

    assert "gpu-already-there" in on_connect and "gpu-new" not in on_connect
    assert 'hx-swap-oob="beforeend:#machine-rows"' in pushed
    assert "gpu-new" in pushed
    assert "Host key to confirm" in pushed
    assert 'id="machine-summary"' in pushed


def test_one_socket_follows_several_topics():
    machine, cookie = MachineFactory(), session_cookie()

    async def scenario():
        ws = socket(f"topic=machines&topic=machine:{machine.pk}", cookie=cookie)
        connected, _ = await ws.connect(timeout=WAIT)
        messages = [await ws.receive_from(timeout=WAIT) for _ in range(3)]  # summary, rows, the machine's cards
        await ws.disconnect()
        return connected, messages

    connected, (summary, rows, cards) = async_to_sync(scenario)()

    assert connected
    assert 'id="machine-summary"' in summary
    assert f'id="machine-row-{machine.pk}"' in rows and "<div" not in rows
    assert 'id="machine-header"' in cards


def test_nothing_is_rendered_while_nobody_watches_and_a_watcher_that_connects_gets_the_pushes(monkeypatch):
    from console import live

    machine, cookie = MachineFactory(state=MachineState.HEALTHY), session_cookie()
    kind = live._kinds["machine"]
    renders = []
    monkeypatch.setitem(live._kinds, "machine", dataclasses.replace(
        kind, renderer=lambda arg, part, role: renders.append(part) or kind.renderer(arg, part, role)))

    def goes(state, reason=""):
        return in_a_transaction(lambda: services.machine_transition(machine=machine, to=state, reason=reason))

    async def scenario():
        await goes(MachineState.OFFLINE, "No heartbeat for 31 s.")
        unwatched = len(renders)
        ws = socket(f"topic=machine:{machine.pk}", cookie=cookie)
        await ws.connect(timeout=WAIT)
        on_connect = await ws.receive_from(timeout=WAIT)
        await goes(MachineState.HEALTHY)
        pushed = await ws.receive_from(timeout=WAIT)
        await ws.disconnect()
        watched = len(renders)
        await goes(MachineState.FAILED, "The host key changed.")
        return unwatched, on_connect, pushed, watched, len(renders)

    unwatched, on_connect, pushed, watched, after = async_to_sync(scenario)()

    assert unwatched == 0
    assert ">Offline</span>" in on_connect  # the change made while nobody watched, rendered on connect
    assert ">Healthy</span>" in pushed
    assert watched == 2  # on connect, then the push
    assert after == watched  # gone again: nothing rendered
