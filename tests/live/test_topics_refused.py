"""A live socket that asks for a topic no app registered, or with an argument its kind does not take,
or whose account has no role, is refused before it subscribes to anything (each such socket left a
group subscription behind)."""
import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from channels_redis.pubsub import RedisPubSubLoopLayer
from django.conf import settings
from django.test import Client

from config.asgi import application
from console import live, roles
from console.consumers import MAX_TOPICS
from tests.factories import NO_ROLE, MachineFactory, UserFactory

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


def connect(query: str, *, role=None) -> tuple[bool, int | None]:
    client = Client()
    client.force_login(UserFactory(role=role))
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


@pytest.mark.parametrize("role", roles.ROLES, ids=str)
def test_a_socket_asking_for_good_topics_joins_its_own_groups_then_each_topics_group_for_its_role(subscriptions, role):
    machine = MachineFactory()
    assert connect(f"topic=machines&topic=machine:{machine.pk}", role=role)[0] is True
    own, topics = subscriptions[:2], subscriptions[2:]
    assert own[0].startswith("live.user.") and own[1].startswith("live.session.")  # console/live_sessions.py
    assert topics == [live.group_name("machines", role), live.group_name(f"machine:{machine.pk}", role)]


def test_a_socket_of_an_account_without_a_role_is_refused_before_it_subscribes(subscriptions):
    assert connect("topic=machines", role=NO_ROLE) == (False, 4403)
    assert subscriptions == []
