"""The one push helper: after commit, once per topic and part, never on rollback."""
import os

import pytest
from django.db import transaction

from console import live, roles


def test_parse_topic_knows_the_registered_topics_and_nothing_else():
    assert live.parse_topic("machines") == ("machines", "")
    assert live.parse_topic("machine:12") == ("machine", "12")
    assert live.parse_topic("clusters-of-someone-else") is None
    assert live.parse_topic("machine:12;DROP") is None
    assert live.parse_topic("Machine:12") is None


def test_group_names_hold_only_what_channels_accepts():
    assert live.group_name("machine:12", roles.VIEWER) == "live.machine.12.viewer"


@pytest.mark.django_db
def test_several_pushes_of_the_same_thing_in_one_transaction_wait_for_one_commit(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        live.push("machine:12")
        live.push("machine:12")
        live.push("machines", part="12")
        live.push("machines", part="12")
        live.push("machines", part="13")

    assert sorted(callback.live_key for callback in callbacks) == [("machine:12", ""), ("machines", "12"), ("machines", "13")]


@pytest.mark.django_db
def test_a_push_in_a_transaction_that_rolls_back_is_never_sent(django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks() as callbacks:
        with pytest.raises(RuntimeError), transaction.atomic():
            live.push("machine:12")
            raise RuntimeError("rolled back")
    assert callbacks == []


# -- who watches, and how a push reaches them -------------------------------------------------------


@pytest.fixture
def renders(monkeypatch):
    """A topic kind ``probe-card`` whose renders are counted: what a push would render."""
    calls = []

    def render(arg, part, role):
        calls.append((arg, part))
        return [f'<div id="card-{arg}" hx-swap-oob="true">{len(calls)}</div>']

    monkeypatch.setitem(live._kinds, "probe-card", live.TopicKind(render, may_see=lambda user, arg: True, takes=live.an_id))
    return calls


@pytest.fixture
def subscriber(isolated_channel_layer):
    """A Redis connection subscribed to a live group the way a web process's channel layer is."""
    import redis
    from django.conf import settings

    from console import pubsub

    client = redis.Redis.from_url(settings.CHANNEL_LAYERS["default"]["CONFIG"]["hosts"][0])
    subscriptions = client.pubsub(ignore_subscribe_messages=True)

    def subscribe(topic: str):
        _, channel = pubsub._redis().channel(live.group_name(topic, roles.VIEWER))
        subscriptions.subscribe(channel)
        subscriptions.get_message(timeout=1)  # the confirmation: Redis counts it from now on
        return subscriptions

    yield subscribe
    subscriptions.close()
    client.close()


@pytest.mark.django_db
def test_a_push_renders_nothing_while_nobody_watches_the_topic(isolated_channel_layer, renders, django_capture_on_commit_callbacks):
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        live.push("probe-card:1")

    assert len(callbacks) == 1
    assert renders == []


@pytest.mark.django_db
def test_a_push_renders_and_publishes_once_somebody_watches_the_topic(renders, subscriber, django_capture_on_commit_callbacks):
    from django.conf import settings

    from console import pubsub

    subscriptions = subscriber("probe-card:1")
    with django_capture_on_commit_callbacks(execute=True):
        live.push("probe-card:1")
        live.push("probe-card:2")  # another topic, which nobody watches

    message = subscriptions.get_message(timeout=2)
    assert renders == [("1", "")]
    assert message is not None
    assert pubsub._redis().layer.deserialize(message["data"]) == {
        "type": "live.html", "html": '<div id="card-1" hx-swap-oob="true">1</div>'}
    assert message["channel"].decode() == settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] + "__group__live.probe-card.1.viewer"


@pytest.mark.django_db
def test_pushes_from_a_process_reuse_one_redis_connection(renders, subscriber, django_capture_on_commit_callbacks):
    from console import pubsub

    subscriber("probe-card:1")
    with django_capture_on_commit_callbacks(execute=True):
        for n in range(20):
            live.push("probe-card:1", part=str(n))

    client, _ = pubsub._redis().channel(live.group_name("probe-card:1", roles.VIEWER))
    pool = client.connection_pool
    assert len(renders) == 20
    assert len(pool._available_connections) + len(pool._in_use_connections) == 1


def test_the_group_channel_is_named_and_placed_as_channels_redis_does(settings):
    """Publishing bypasses the layer's group_send; this pins it to the layer's own naming and sharding."""
    from asgiref.sync import async_to_sync
    from channels.layers import channel_layers, get_channel_layer

    from console import pubsub

    settings.CHANNEL_LAYERS = {"default": {**settings.CHANNEL_LAYERS["default"], "CONFIG": {
        "hosts": ["redis://127.0.0.1:6379/5", "redis://127.0.0.1:6379/6", "redis://127.0.0.1:6379/7"], "prefix": "pin"}}}
    channel_layers.backends.clear()
    try:
        async def layers_own():
            loop_layer = get_channel_layer()._get_layer()
            names = [loop_layer._get_group_channel_name(live.group_name(f"machine:{n}", roles.VIEWER)) for n in range(30)]
            return [(name, loop_layer._shards.index(loop_layer._get_shard(name))) for name in names]

        ours = []
        for n in range(30):
            client, name = pubsub._redis().channel(live.group_name(f"machine:{n}", roles.VIEWER))
            ours.append((name, pubsub._redis().shards.index(client)))

        assert ours == async_to_sync(layers_own)()
        assert len({shard for _, shard in ours}) > 1
    finally:
        channel_layers.backends.clear()


def test_the_live_prefix_is_the_queue_s_unless_set():
    """Consoles on one Redis server keep their pub/sub channels apart by it: one per queue by default."""
    import subprocess
    import sys

    def prefix(**env) -> str:
        environ = {k: v for k, v in os.environ.items() if k not in ("FADEN_LIVE_PREFIX", "FADEN_CELERY_QUEUE")}
        code = "from config import settings as s; print(s.CHANNEL_LAYERS['default']['CONFIG']['prefix'])"
        return subprocess.run([sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True,
                              check=True).stdout.strip()

    assert prefix() == "fadenstack.live"
    assert prefix(FADEN_CELERY_QUEUE="second") == "second.live"
    assert prefix(FADEN_CELERY_QUEUE="second", FADEN_LIVE_PREFIX="own") == "own"
