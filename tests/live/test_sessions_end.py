"""A live socket ends with its session: logout, a new password, a deactivated account close it."""
import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.conf import settings
from django.test import Client

from machines import services
from machines.choices import MachineState
from tests.factories import MachineFactory, UserFactory
from tests.live.test_websocket import WAIT, in_a_transaction, socket

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("isolated_channel_layer")]

CLOSED = {"type": "websocket.close", "code": 4401}


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
