"""A live socket that asks for a topic no app registered, or with an argument its kind does not take,
is refused before it subscribes to anything (each such socket left a group subscription behind)."""
import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from channels_redis.pubsub import RedisPubSubLoopLayer
from django.conf import settings
from django.test import Client

from config.asgi import application
from console.consumers import MAX_TOPICS
from tests.factories import MachineFactory, UserFactory

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("isolated_channel_layer")]


@pytest.fixture
def subscriptions(monkeypatch):
    """Every group a socket joined."""
    joined = []
    real = RedisPubSubLoopLayer.group_add

    async def group_add(layer, group, channel):
        joined.append(group)
        return await real(layer, group, channel)

    monkeypatch.setattr(RedisPubSubLoopLayer, "group_add", group_add)
    return joined


def connect(query: str) -> tuple[bool, int | None]:
    client = Client()
    client.force_login(UserFactory())
    cookie = f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}"
    headers = [(b"host", b"testserver"), (b"origin", b"http://testserver"), (b"cookie", cookie.encode())]

    async def scenario():
        ws = WebsocketCommunicator(application, f"/ws/live/?{query}", headers=headers)
        connected, code = await ws.connect()
        await ws.disconnect()
        return connected, code

    return async_to_sync(scenario)()


@pytest.mark.parametrize("topics", [
    ["machine:abc"], [f"machine:{2**63}"], ["machine:012"], ["machines:other"], ["cluster:"], ["secrets"],
    ["machines", "machine:abc"],  # one bad topic refuses the socket, not only that topic
    ["machines"] * (MAX_TOPICS + 1),
])
def test_a_socket_asking_for_a_topic_it_cannot_have_is_refused_before_it_subscribes(subscriptions, topics):
    assert connect("&".join(f"topic={topic}" for topic in topics)) == (False, 4403)
    assert subscriptions == []


def test_a_socket_with_a_query_string_that_is_not_utf8_is_refused():
    MachineFactory()
    assert connect("topic=machine:%ff") == (False, 4403)


def test_a_socket_asking_for_good_topics_subscribes_to_each(subscriptions):
    machine = MachineFactory()
    assert connect(f"topic=machines&topic=machine:{machine.pk}")[0] is True
    assert subscriptions[-2:] == ["live.machines", f"live.machine.{machine.pk}"]  # after the user's and session's own
