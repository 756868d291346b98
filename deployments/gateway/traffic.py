"""Requests, errors and latency per deployment: counted in each gateway's memory, added up in Redis.

Each gateway process counts on its event loop (``Counts``, a few integer additions per request) and
every second adds what it counted to one Redis hash per deployment and minute,
``<prefix>:traffic:<deployment id>:<minute>`` (HINCRBY, kept an hour), so any number of gateway
processes add up. The fields: ``requests``, ``errors`` (answers of 500 and above, and copies that
could not be reached or broke off), ``latency_ms`` (their sum) and ``h<i>``, how many took at most
``LATENCY_BOUNDS_MS[i]`` (``h<len>``: longer), from which the pages read p50 and p99. The gateway's
own refusals (bad key, unknown model, bad body) are counted under ``<prefix>:traffic:gateway:<minute>``.

Each process also says it is alive: a sorted set ``<prefix>:processes`` of ``host:pid`` scored by the
time of its last flush, with what its tables hold under ``<prefix>:process:<host:pid>``.

``traffic(deployment_ids)`` is what the pages call; it reads Redis and never raises (no figures is
an answer the page shows).
"""
from __future__ import annotations

import bisect
import json
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

# Upper bounds of the latency histogram, in milliseconds: fine where the gateway's own cost shows,
# coarse where a long generation is.
LATENCY_BOUNDS_MS = (1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 150, 200, 300, 500, 750, 1000, 1500, 2000, 3000,
                     5000, 7500, 10000, 15000, 20000, 30000, 60000, 120000, 300000)
KEEP_SECONDS = 3600  # each minute's hash; the pages read the last WINDOW_MINUTES and a SPARK_MINUTES sparkline
WINDOW_MINUTES = 5
SPARK_MINUTES = 30
ALIVE_SECONDS = 5  # a process that has not flushed for this long is not counted as up


@dataclass
class Figures:
    """One deployment's counts since the last flush."""

    requests: int = 0
    errors: int = 0
    latency_ms: float = 0.0
    buckets: dict[int, int] = field(default_factory=dict)


class Counts:
    """What one gateway process counted since its last flush (used on its event loop only)."""

    def __init__(self):
        self.deployments: dict[int, Figures] = {}
        self.refused = 0  # the gateway's own refusals: bad key, unknown model, bad body

    def record(self, deployment_id: int, *, seconds: float, error: bool) -> None:
        figures = self.deployments.get(deployment_id)
        if figures is None:
            figures = self.deployments[deployment_id] = Figures()
        milliseconds = seconds * 1000.0
        figures.requests += 1
        figures.errors += error
        figures.latency_ms += milliseconds
        bucket = bisect.bisect_left(LATENCY_BOUNDS_MS, milliseconds)
        figures.buckets[bucket] = figures.buckets.get(bucket, 0) + 1

    def __bool__(self) -> bool:
        return bool(self.deployments or self.refused)


def redis_client(url: str):
    """A client that gives up quickly: a Redis that does not answer must not hold the gateway's threads."""
    import redis

    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2, health_check_interval=30)


def minute_of(at: float) -> int:
    return int(at // 60)


def counts_flush(client, prefix: str, counts: Counts, *, at: float | None = None) -> None:
    """Add ``counts`` to this minute's hashes in one round trip."""
    if not counts:
        return
    minute = minute_of(time.time() if at is None else at)
    pipe = client.pipeline(transaction=False)
    for deployment_id, figures in counts.deployments.items():
        name = f"{prefix}:traffic:{deployment_id}:{minute}"
        pipe.hincrby(name, "requests", figures.requests)
        if figures.errors:
            pipe.hincrby(name, "errors", figures.errors)
        pipe.hincrbyfloat(name, "latency_ms", round(figures.latency_ms, 3))
        for bucket, count in figures.buckets.items():
            pipe.hincrby(name, f"h{bucket}", count)
        pipe.expire(name, KEEP_SECONDS)
    if counts.refused:
        name = f"{prefix}:traffic:gateway:{minute}"
        pipe.hincrby(name, "refused", counts.refused)
        pipe.expire(name, KEEP_SECONDS)
    pipe.execute()


def process_alive(client, prefix: str, process: str, state: dict, *, at: float | None = None) -> None:
    """Say this gateway process is up, with what its tables hold (shown on the Gateway page)."""
    now = time.time() if at is None else at
    pipe = client.pipeline(transaction=False)
    pipe.zadd(f"{prefix}:processes", {process: now})
    pipe.zremrangebyscore(f"{prefix}:processes", "-inf", now - KEEP_SECONDS)
    pipe.set(f"{prefix}:process:{process}", json.dumps(state), ex=ALIVE_SECONDS * 4)
    pipe.execute()


# -- what the pages read ------------------------------------------------------------------------------


@dataclass
class Traffic:
    """One deployment's figures over the last WINDOW_MINUTES, and requests per minute for the sparkline."""

    requests: int = 0
    errors: int = 0
    latency_ms: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_MS) + 1))
    per_minute: list[int] = field(default_factory=lambda: [0] * SPARK_MINUTES)  # oldest first, this minute last

    @property
    def requests_per_minute(self) -> float:
        return self.requests / WINDOW_MINUTES

    @property
    def error_percent(self) -> float:
        return 100.0 * self.errors / self.requests if self.requests else 0.0

    @property
    def mean_ms(self) -> float | None:
        return self.latency_ms / self.requests if self.requests else None

    @property
    def p50_ms(self) -> float | None:
        return percentile(self.buckets, 0.50)

    @property
    def p99_ms(self) -> float | None:
        return percentile(self.buckets, 0.99)

    @property
    def spark(self) -> list[dict]:
        """The sparkline's bars: x and height in a 0..100 x 0..24 box (the template draws them as SVG)."""
        top = max(self.per_minute) or 1
        width = 100 / SPARK_MINUTES
        return [{"x": round(i * width, 2), "w": round(width * 0.7, 2), "h": round(max(24 * n / top, 1 if n else 0), 2),
                 "y": round(24 - max(24 * n / top, 1 if n else 0), 2), "n": n, "ago": SPARK_MINUTES - 1 - i}
                for i, n in enumerate(self.per_minute)]


def percentile(buckets: list[int], q: float) -> float | None:
    """The q-quantile of a histogram over LATENCY_BOUNDS_MS, interpolated within its bucket; None when
    empty, and the last bound when it falls past it (the page says "over")."""
    total = sum(buckets)
    if not total:
        return None
    rank = q * total
    seen = 0
    for index, count in enumerate(buckets):
        if count and seen + count >= rank:
            if index >= len(LATENCY_BOUNDS_MS):
                return float(LATENCY_BOUNDS_MS[-1])
            low = LATENCY_BOUNDS_MS[index - 1] if index else 0.0
            high = LATENCY_BOUNDS_MS[index]
            return low + (high - low) * (rank - seen) / count
        seen += count
    return float(LATENCY_BOUNDS_MS[-1])


def _settings_client():
    from django.conf import settings

    return redis_client(settings.REDIS_URL), settings.FADEN_GATEWAY_REDIS_PREFIX


def traffic(deployment_ids, *, at: float | None = None, client=None, prefix: str | None = None) -> dict[int, Traffic]:
    """Each deployment's figures (an empty ``Traffic`` when it had none); {} when Redis does not answer."""
    ids = list(dict.fromkeys(deployment_ids))
    if not ids:
        return {}
    if client is None:
        client, prefix = _settings_client()
    now = minute_of(time.time() if at is None else at)
    minutes = [now - back for back in range(SPARK_MINUTES - 1, -1, -1)]
    pipe = client.pipeline(transaction=False)
    for pk in ids:
        for minute in minutes:
            pipe.hgetall(f"{prefix}:traffic:{pk}:{minute}")
    try:
        answers = iter(pipe.execute())
    except Exception as exc:  # redis' errors and the socket's: the page says figures are missing
        log.warning("Gateway figures unavailable: %s", exc)
        return {}
    found: dict[int, Traffic] = {}
    for pk in ids:
        figures = found[pk] = Traffic()
        for index, minute in enumerate(minutes):
            fields = next(answers)
            if not fields:
                continue
            figures.per_minute[index] = int(fields.get(b"requests", 0))
            if minute > now - WINDOW_MINUTES:
                _minute_add(figures, fields)
    return found


def _minute_add(figures: Traffic, fields: dict) -> None:
    """Add one minute's hash to ``figures``."""
    figures.requests += int(fields.get(b"requests", 0))
    figures.errors += int(fields.get(b"errors", 0))
    figures.latency_ms += float(fields.get(b"latency_ms", 0))
    for name, value in fields.items():
        if name.startswith(b"h") and name[1:].isdigit() and int(name[1:]) < len(figures.buckets):
            figures.buckets[int(name[1:])] += int(value)


def traffic_minutes(deployment_id: int, minutes: list[int], *, client=None, prefix: str | None = None) -> list[Traffic] | None:
    """The deployment's figures in each of ``minutes`` (``minute_of``'s numbers; an empty ``Traffic`` for a
    minute without requests, kept KEEP_SECONDS), for the deployment's charts; None when Redis does not answer."""
    if client is None:
        client, prefix = _settings_client()
    pipe = client.pipeline(transaction=False)
    for minute in minutes:
        pipe.hgetall(f"{prefix}:traffic:{deployment_id}:{minute}")
    try:
        answers = pipe.execute()
    except Exception as exc:  # redis' errors and the socket's: the charts say figures are missing
        log.warning("Gateway figures unavailable: %s", exc)
        return None
    found = []
    for fields in answers:
        figures = Traffic()
        _minute_add(figures, fields or {})
        found.append(figures)
    return found


def gateway_refused(*, at: float | None = None, client=None, prefix: str | None = None) -> int | None:
    """Requests the gateways refused themselves over the last WINDOW_MINUTES; None when Redis does not answer."""
    if client is None:
        client, prefix = _settings_client()
    now = minute_of(time.time() if at is None else at)
    pipe = client.pipeline(transaction=False)
    for back in range(WINDOW_MINUTES):
        pipe.hget(f"{prefix}:traffic:gateway:{now - back}", "refused")
    try:
        return sum(int(value or 0) for value in pipe.execute())
    except Exception as exc:
        log.warning("Gateway figures unavailable: %s", exc)
        return None


def gateway_processes(*, at: float | None = None, client=None, prefix: str | None = None) -> list[dict] | None:
    """The gateway processes that flushed in the last ALIVE_SECONDS, each with what its tables hold;
    None when Redis does not answer."""
    if client is None:
        client, prefix = _settings_client()
    now = time.time() if at is None else at
    try:
        names = [name.decode() for name in client.zrangebyscore(f"{prefix}:processes", now - ALIVE_SECONDS, "+inf")]
        states = client.mget([f"{prefix}:process:{name}" for name in names]) if names else []
    except Exception as exc:
        log.warning("Gateway processes unavailable: %s", exc)
        return None
    return [{"process": name, **(json.loads(state) if state else {})} for name, state in zip(names, states)]
