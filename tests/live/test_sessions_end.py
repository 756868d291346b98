"""A live socket ends with its session: logout, a new password, a deactivated account close it. A new
role closes it too, with the code that asks the page to reconnect, and the new socket follows the new role."""
import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.conf import settings
from django.test import Client

from console import users
from console.roles import OPERATOR, VIEWER
from machines import services
from machines.choices import MachineState
from tests.factories import MachineFactory, UserFactory
from tests.live.test_roles_live import refresh_button
from tests.live.test_websocket import WAIT, in_a_transaction, socket

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("isolated_channel_layer")]

CLOSED = {"type": "websocket.close", "code": 4401}
RECONNECT = {"type": "websocket.close", "code": 4000}  # static/js/console.js connects again at once


def signed_in(user) -> tuple[Client, str]:
    """A browser signed in as ``user``, and its session cookie for the socket."""
    client = Client()
    client.force_login(user)
    return client, f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"


def watch_while(change, *, cookie: str, machine, other_cookie: str = ""):
    """Open a socket on the machine (and one of another session), make ``change``, then change the machine.

    Returns what the socket got after ``change``, whether the machine's card still arrived on it
    afterwards, and the other socket's first message after the machine changed.
    """

    async def scenario():
        watching = socket(f"topic=machine:{machine.pk}", cookie=cookie)
        assert (await watching.connect())[0]
        await watching.receive_from(timeout=WAIT)
        other = None
        if other_cookie:
            other = socket(f"topic=machine:{machine.pk}", cookie=other_cookie)
            assert (await other.connect())[0]
            await other.receive_from(timeout=WAIT)
        await database_sync_to_async(change)()
        ended = await watching.receive_output(timeout=WAIT)
        await in_a_transaction(lambda: services.machine_transition(machine=machine, to=MachineState.OFFLINE))
        quiet_after = await watching.receive_nothing(timeout=1)
        other_got = await other.receive_from(timeout=WAIT) if other else ""
        if other:
            await other.disconnect()
        return ended, quiet_after, other_got

    return async_to_sync(scenario)()


def test_logging_out_closes_that_session_s_socket_and_no_card_arrives_after_but_other_sessions_go_on():
    machine, user = MachineFactory(state=MachineState.HEALTHY), UserFactory()
    browser, cookie = signed_in(user)
    _, other_cookie = signed_in(user)

    ended, quiet_after, other_got = watch_while(lambda: browser.post("/logout/"), cookie=cookie, machine=machine,
                                                other_cookie=other_cookie)

    assert ended == CLOSED
    assert quiet_after
    assert ">Offline</span>" in other_got  # the same user's other browser still follows the machine


def test_a_new_password_closes_every_socket_of_the_user_and_the_old_session_cannot_reconnect():
    machine, user = MachineFactory(state=MachineState.HEALTHY), UserFactory()
    _, cookie = signed_in(user)

    def change_password():
        user.set_password("a-new-password-nobody-guessed")
        user.save()

    ended, quiet_after, _ = watch_while(change_password, cookie=cookie, machine=machine)

    async def reconnect():
        again = socket(f"topic=machine:{machine.pk}", cookie=cookie)
        return await again.connect()

    assert ended == CLOSED
    assert quiet_after
    assert async_to_sync(reconnect)() == (False, 4401)


def test_deactivating_the_account_closes_its_sockets():
    machine, user = MachineFactory(state=MachineState.HEALTHY), UserFactory()
    _, cookie = signed_in(user)

    def deactivate():
        user.is_active = False
        user.save()

    ended, quiet_after, _ = watch_while(deactivate, cookie=cookie, machine=machine)

    assert ended == CLOSED
    assert quiet_after


def test_saving_a_user_without_changing_the_password_or_deactivating_leaves_the_sockets_open():
    machine, user = MachineFactory(state=MachineState.HEALTHY), UserFactory()
    _, cookie = signed_in(user)

    def rename():
        user.first_name = "Ada"
        user.save()
        signed_in(user)  # another login: last_login is saved

    async def scenario():
        watching = socket(f"topic=machine:{machine.pk}", cookie=cookie)
        await watching.connect()
        await watching.receive_from(timeout=WAIT)
        await database_sync_to_async(rename)()
        await in_a_transaction(lambda: services.machine_transition(machine=machine, to=MachineState.OFFLINE))
        pushed = await watching.receive_from(timeout=WAIT)
        await watching.disconnect()
        return pushed

    assert ">Offline</span>" in async_to_sync(scenario)()


def test_a_new_role_closes_the_user_s_sockets_to_reconnect_and_the_new_socket_gets_the_new_role_s_cards():
    machine, administrator = MachineFactory(state=MachineState.HEALTHY), UserFactory(username="ada")
    bob = UserFactory(username="bob", role=VIEWER)
    _, cookie = signed_in(bob)
    _, administrators_cookie = signed_in(administrator)

    ended, quiet_after, others_got = watch_while(
        lambda: users.user_role_change(user=bob, role=OPERATOR, by=administrator), cookie=cookie, machine=machine,
        other_cookie=administrators_cookie)

    async def reconnect():
        again = socket(f"topic=machine:{machine.pk}", cookie=cookie)
        connected, _ = await again.connect()
        card = await again.receive_from(timeout=WAIT)
        await again.disconnect()
        return connected, card

    connected, card = async_to_sync(reconnect)()
    assert ended == RECONNECT
    assert quiet_after  # no card for the old role after the close
    assert ">Offline</span>" in others_got  # another user's socket goes on
    assert connected and "disabled" not in refresh_button(card)  # the session holds, and the cards are an Operator's


def test_saving_a_user_s_role_unchanged_leaves_the_sockets_open():
    machine, administrator = MachineFactory(state=MachineState.HEALTHY), UserFactory(username="ada")
    bob = UserFactory(username="bob", role=VIEWER)
    _, cookie = signed_in(bob)

    async def scenario():
        watching = socket(f"topic=machine:{machine.pk}", cookie=cookie)
        await watching.connect()
        await watching.receive_from(timeout=WAIT)
        await database_sync_to_async(users.user_role_change)(user=bob, role=VIEWER, by=administrator)
        await in_a_transaction(lambda: services.machine_transition(machine=machine, to=MachineState.OFFLINE))
        pushed = await watching.receive_from(timeout=WAIT)
        await watching.disconnect()
        return pushed

    assert ">Offline</span>" in async_to_sync(scenario)()
