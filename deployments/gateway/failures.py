"""A copy the gateway could not reach, reported to the console through Redis.

When a copy refuses a connection (or the connection times out, or breaks off before an answer), the
gateway takes it out of its rotation at once, sends the request to another copy, and reports it:
one JSON object LPUSHed on ``<prefix>:failed`` (FADEN_GATEWAY_REDIS_PREFIX, ``faden:gateway`` by
default, so ``faden:gateway:failed``), at most ``KEEP`` kept::

    {"copy": 12, "deployment": 3, "name": "llama", "number": 2, "url": "http://198.18.1.12:8100",
     "error": "Connection refused", "at": "2025-01-01T12:00:00+00:00", "gateway": "host:1234"}

The console's health check takes them with ``failures_take`` (oldest first) and looks at those
copies at once: it looks twice, then restarts the copy. The same report also goes on
``<prefix>:failed:recent`` (the last ``RECENT`` of them, never taken) for the Gateway page.

A copy out of rotation comes back in the gateway by itself: the gateway asks its ``/health`` every
FADEN_GATEWAY_PROBE seconds and puts it back on the first 200, and a copy the console started
again (a new serving time in the database) comes back with a clean slate.
"""
from __future__ import annotations

import json
import logging

log = logging.getLogger(__name__)

KEEP = 1000  # reports waiting for the console; older ones go (a check looks at the copy anyway)
RECENT = 50


def failure_report(client, prefix: str, reports: list[dict]) -> None:
    """Push the reports (oldest first) in one round trip."""
    if not reports:
        return
    encoded = [json.dumps(report, separators=(",", ":")) for report in reports]
    pipe = client.pipeline(transaction=False)
    pipe.lpush(f"{prefix}:failed", *encoded)
    pipe.ltrim(f"{prefix}:failed", 0, KEEP - 1)
    pipe.lpush(f"{prefix}:failed:recent", *encoded)
    pipe.ltrim(f"{prefix}:failed:recent", 0, RECENT - 1)
    pipe.execute()


def failures_take(*, limit: int = 100, client=None, prefix: str | None = None) -> list[dict]:
    """The reports waiting for the console, oldest first, taken off the list (each is read once)."""
    if client is None:
        client, prefix = _settings_client()
    raw = client.rpop(f"{prefix}:failed", limit) or []
    return [json.loads(item) for item in raw]


def failures_recent(*, limit: int = 10, client=None, prefix: str | None = None) -> list[dict] | None:
    """The latest reports, newest first, for the Gateway page; None when Redis does not answer."""
    if client is None:
        client, prefix = _settings_client()
    try:
        return [json.loads(item) for item in client.lrange(f"{prefix}:failed:recent", 0, limit - 1)]
    except Exception as exc:  # redis' errors and the socket's: the page says so
        log.warning("Gateway failures unavailable: %s", exc)
        return None


def _settings_client():
    from django.conf import settings

    from deployments.gateway.traffic import redis_client

    return redis_client(settings.REDIS_URL), settings.FADEN_GATEWAY_REDIS_PREFIX
