"""Two consoles on one Redis server never hear each other's live cards.

Redis pub/sub ignores the database number, so the consoles keep apart by their channel prefix
(FADEN_LIVE_PREFIX, by default one per queue). Console A is this test process (its layer under a
prefix of its own, its sockets through Channels' communicator); console B is a Daphne process
with another queue, on another Redis database of the same server, and the same test database: both
show the same machine, so without their prefixes each would hear the other's pushes.
"""
import asyncio
import hashlib
import json
import urllib.request
from urllib.parse import urlsplit, urlunsplit

import pytest
from asgiref.sync import async_to_sync
from channels.db import database_sync_to_async
from django.conf import settings
from django.db import transaction
from websockets.asyncio.client import connect

from machines import services
from machines.choices import MachineState
from tests.factories import MachineFactory
from tests.live.test_websocket import WAIT, session_cookie, socket
from tests.processes import console_processes

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("isolated_channel_layer")]

HEARTBEAT_TOKEN = "the-token-of-the-machine-both-consoles-show"
QUIET = 1.5  # seconds a socket must stay silent to count as not reached


def other_redis_database(url: str) -> str:
    """The same Redis server, another database number."""
    parts = urlsplit(url)
    number = int(parts.path.strip("/") or 0)
    return urlunsplit(parts._replace(path=f"/{(number + 1) % 16}"))


@pytest.fixture(scope="module")
def console_b(django_db_setup):
    """Another console on the same Redis server: a queue, and so a live prefix, of its own (the default
    one, derived from its queue: an empty FADEN_LIVE_PREFIX is no prefix set)."""
    env = {"REDIS_URL": other_redis_database(settings.REDIS_URL), "FADEN_LIVE_PREFIX": ""}
    with console_processes(worker=False, env=env) as console:
        yield console


def heartbeat(console_url: str) -> dict:
    """The machine's agent beats to console B: B brings it back Healthy and pushes its cards."""
    request = urllib.request.Request(f"{console_url}/agent/heartbeat/", data=json.dumps({"agent_version": "0.1.0"}).encode(),
                                     headers={"Authorization": f"Bearer {HEARTBEAT_TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


async def silent(receive) -> bool:
    try:
        await asyncio.wait_for(receive(), timeout=QUIET)
    except TimeoutError:
        return True
    return False


def test_a_card_pushed_by_one_console_never_reaches_a_socket_of_another_on_the_same_redis(console_b):
    machine = MachineFactory(state=MachineState.HEALTHY, heartbeat_token_hash=hashlib.sha256(HEARTBEAT_TOKEN.encode()).hexdigest())
    cookie = session_cookie()
    topic = f"topic=machine:{machine.pk}"
    host = urlsplit(console_b.url).netloc

    def goes_offline():
        with transaction.atomic():
            services.machine_transition(machine=machine, to=MachineState.OFFLINE, reason="No heartbeat for 31 s.")

    async def scenario():
        on_a = socket(topic, cookie=cookie)
        assert (await on_a.connect())[0]
        await on_a.receive_from(timeout=WAIT)
        async with connect(f"ws://{host}/ws/live/?{topic}", origin=f"http://{host}", additional_headers={"Cookie": cookie}) as on_b:
            assert ">Healthy</span>" in await asyncio.wait_for(on_b.recv(), WAIT)

            await database_sync_to_async(goes_offline)()  # pushed by console A
            seen = {"a": await on_a.receive_from(timeout=WAIT), "b silent": await silent(on_b.recv)}

            beat = await asyncio.to_thread(heartbeat, console_b.url)  # pushed by console B
            seen |= {"beat": beat["state"], "b": await asyncio.wait_for(on_b.recv(), WAIT),
                     "a silent": await on_a.receive_nothing(timeout=QUIET)}
        await on_a.disconnect()
        return seen

    seen = async_to_sync(scenario)()

    assert ">Offline</span>" in seen["a"] and seen["b silent"]
    assert seen["beat"] == MachineState.HEALTHY
    assert ">Healthy</span>" in seen["b"] and seen["a silent"]
