"""Live groups from synchronous code: whether anyone watches a group, and sending to it.

The console's channel layer is channels_redis's RedisPubSubChannelLayer. There a
group is the Redis pub/sub channel ``<prefix>__group__<group>`` (on the Redis the
name hashes to, when there are several). Pub/sub channels ignore the database number,
so the prefix (``FADEN_LIVE_PREFIX``, read from the layer's settings here as the layer
reads it) is what keeps consoles sharing a Redis server apart. Each web process subscribes to it
while at least one of its websockets is in the group. So Redis itself knows who
watches: PUBSUB NUMSUB counts the subscribed connections of every web process,
and a process that dies leaves with its connection, so there is no count of our
own to keep up or to expire. No subscriber means a PUBLISH now would reach
nobody: skipping the render then loses nothing that sending it would have
delivered, and a websocket that connects later renders its cards itself.

Sending is the PUBLISH the layer's own group_send makes, of the message
serialised by the layer itself, on a connection pool this process keeps (redis-py
pools reconnect after a fork): no event loop and no new Redis connection per push.

With another layer (the in-memory one, say) every group counts as watched and
messages go through the layer's group_send.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass

import redis
from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from channels_redis.pubsub import RedisPubSubChannelLayer
from channels_redis.utils import _consistent_hash, decode_hosts
from django.conf import settings

TIMEOUT = 2  # seconds: a push is a hint, not worth holding a request up longer


@dataclass(frozen=True)
class _Redis:
    """The Redis servers behind one pub/sub channel layer, with a client each."""

    layer: RedisPubSubChannelLayer
    prefix: str
    shards: tuple[redis.Redis, ...]

    def channel(self, group: str) -> tuple[redis.Redis, str]:
        # As RedisPubSubLoopLayer._get_group_channel_name and _get_shard name and place it.
        name = f"{self.prefix}__group__{group}"
        return self.shards[_consistent_hash(name, len(self.shards))], name


_lock = threading.Lock()
_current: _Redis | None = None


def _client(host: dict) -> redis.Redis:
    """A client for one of the layer's hosts, as channels_redis reads them (a URL, or host and port)."""
    options = {"socket_connect_timeout": TIMEOUT, "socket_timeout": TIMEOUT, **host}
    if "address" in options:
        return redis.Redis.from_url(options.pop("address"), **options)
    return redis.Redis(**options)


def _redis() -> _Redis | None:
    """The Redis behind the channel layer in use, or None when the layer is not the pub/sub one."""
    global _current
    layer = get_channel_layer()
    if not isinstance(layer, RedisPubSubChannelLayer):
        return None
    with _lock:
        if _current is None or _current.layer is not layer:  # the first push, or settings changed (tests)
            config = settings.CHANNEL_LAYERS["default"].get("CONFIG", {})
            shards = tuple(_client(host) for host in decode_hosts(config.get("hosts")))
            _current = _Redis(layer, config.get("prefix", "asgi"), shards)
        return _current


def watched(group: str) -> bool:
    """Whether any websocket, in any web process, is in the group now."""
    target = _redis()
    if target is None:
        return True
    client, channel = target.channel(group)
    [(_, subscribers)] = client.pubsub_numsub(channel)
    return subscribers > 0


def send(group: str, message: dict) -> None:
    """Send ``message`` to every websocket in the group, as the layer's group_send does."""
    target = _redis()
    if target is None:
        _send_through_layer(group, message)
        return
    client, channel = target.channel(group)
    client.publish(channel, target.layer.serialize(message))


def _send_through_layer(group: str, message: dict) -> None:
    send_now = async_to_sync(get_channel_layer().group_send)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        send_now(group, message)
        return
    # Sync code running inside an event loop's thread cannot block on it: send from a helper thread.
    sender = threading.Thread(target=send_now, args=(group, message))
    sender.start()
    sender.join()
