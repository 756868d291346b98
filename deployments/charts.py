"""The deployment page's charts of the last hour: its traffic at the gateway, minute by minute (Redis:
deployments/gateway/traffic.py), beside what its copies' engines said at each health check (the database:
``EngineSample``, deployments/engine_metrics.py). Drawn by console/charts.py.

The gateway's side draws the last 60 whole minutes (the current one is not over: its count would dip).
The engines' side is a point a minute, the last one now: at each point every copy counts with its latest
sample if that is at most ``hold_seconds()`` old (a copy not read for longer, or gone, counts for nothing
there; when no copy counts, the line has a gap). Gauges (requests running and waiting, KV-cache use) are as
sampled; a counter's rate (tokens generated per second, the prefix cache's hits over its queries) is taken
between a copy's sample and its latest one at least ``RATE_SPAN`` seconds before; a counter that went down
started again (the engine restarted): its new value is what it counted since.
"""
from __future__ import annotations

import bisect
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime, timezone as dt_timezone

from django.conf import settings

from console import charts
from console.charts import Series
from deployments.gateway import traffic

MINUTES = 60
RATE_SPAN = 30  # seconds: a rate over less would swing with each request
PER_COPY_LINES = 4  # KV-cache use: a line per copy up to this many copies, else their mean and the highest
COPY_TONES = ("accent", "green", "amber", "blue")


def hold_seconds() -> float:
    """How long a copy's sample stands for it: two and a half checks (one check may be late or skipped)."""
    return max(150.0, 2.5 * settings.FADEN_HEALTH_INTERVAL)


# -- the gateway's side -----------------------------------------------------------------------------------


def gateway_charts(deployment_id: int, *, at: float | None = None, client=None, prefix: str | None = None) -> dict:
    """Requests and errors per minute, and latency p50 and p99, over the last hour; ``unavailable`` when
    Redis does not answer."""
    now = time.time() if at is None else at
    current = traffic.minute_of(now)
    minutes = list(range(current - MINUTES, current))
    found = traffic.traffic_minutes(deployment_id, minutes, client=client, prefix=prefix)
    if found is None:
        return {"unavailable": True, "charts": []}
    agos = [now - (minute + 1) * 60 for minute in minutes]
    quiet = not any(f.requests for f in found)
    requests = Series("Requests", [(ago, f.requests) for ago, f in zip(agos, found)], "accent")
    errors = Series("Errors", [(ago, f.errors) for ago, f in zip(agos, found)], "red")
    p50 = Series("p50", [(ago, f.p50_ms if f.requests else None) for ago, f in zip(agos, found)], "accent")
    p99 = Series("p99", [(ago, f.p99_ms if f.requests else None) for ago, f in zip(agos, found)], "amber")
    counted = charts.line_chart(title="Requests", unit="per minute", series=[requests, errors])
    if quiet:  # a flat line at 0, and the words
        counted["empty"] = "No requests in the last hour"
    latency = charts.line_chart(title="Latency", unit="per minute", series=[p50, p99], fmt=charts.ms, area=False,
                                empty="No requests in the last hour")
    return {"unavailable": False, "charts": [counted, latency]}


# -- the engines' side ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One ``EngineSample`` as plain data: ``at`` in seconds since the epoch."""

    copy_pk: int
    copy_number: int
    at: float
    running: float | None = None
    waiting: float | None = None
    kv_cache: float | None = None
    prefix_hits: float | None = None
    prefix_queries: float | None = None
    generation_tokens: float | None = None


FIELDS = ("running", "waiting", "kv_cache", "prefix_hits", "prefix_queries", "generation_tokens")


def samples_of(deployment, *, now: float) -> list[Sample]:
    """The deployment's samples the charts need: the hour, and before it what the first points stand on."""
    since = datetime.fromtimestamp(now - MINUTES * 60 - hold_seconds() - RATE_SPAN, tz=dt_timezone.utc)
    rows = (deployment.engine_samples.filter(taken_at__gte=since).order_by("taken_at")
            .values_list("copy_pk", "copy_number", "taken_at", *FIELDS))
    return [Sample(pk, number, at.timestamp(), *figures) for pk, number, at, *figures in rows]


@dataclass
class EngineSeries:
    """The engines' figures at each point (oldest first); None where nothing stands for it."""

    agos: list[float]
    running: list[float | None]
    waiting: list[float | None]
    kv_by_copy: dict[str, list[float | None]]  # "#1", or "mean" and "highest": percent
    prefix_hit_percent: list[float | None]
    generation_per_second: list[float | None]


def engine_series(samples: list[Sample], *, now: float, hold: float) -> EngineSeries:
    """The figures the charts draw, from the samples (any order)."""
    by_copy: dict[int, list[Sample]] = defaultdict(list)
    for sample in sorted(samples, key=lambda s: s.at):
        by_copy[sample.copy_pk].append(sample)
    read = [(rows, [s.at for s in rows]) for rows in by_copy.values()]
    numbers = sorted({s.copy_number for s in samples})
    per_copy = len(numbers) <= PER_COPY_LINES
    agos = [60.0 * back for back in range(MINUTES, -1, -1)]
    found = EngineSeries(agos=agos, running=[], waiting=[], prefix_hit_percent=[], generation_per_second=[],
                         kv_by_copy={f"#{n}": [] for n in numbers} if per_copy else {"mean": [], "highest": []})
    for ago in agos:
        standing = _standing(read, at=now - ago, hold=hold)
        latests = [latest for latest, _ in standing]
        found.running.append(_total(s.running for s in latests))
        found.waiting.append(_total(s.waiting for s in latests))
        # A copy's number taken over by its replacement (both read in the hold): the latest sample speaks.
        kv = {s.copy_number: 100.0 * s.kv_cache for s in sorted(latests, key=lambda s: s.at) if s.kv_cache is not None}
        if per_copy:
            for number in numbers:
                found.kv_by_copy[f"#{number}"].append(kv.get(number))
        else:
            found.kv_by_copy["mean"].append(sum(kv.values()) / len(kv) if kv else None)
            found.kv_by_copy["highest"].append(max(kv.values(), default=None))
        rates = [(latest.at - earlier.at, _increase(latest, earlier, "generation_tokens")) for latest, earlier in standing if earlier]
        found.generation_per_second.append(_total(tokens / seconds for seconds, tokens in rates if tokens is not None))
        looked_up = [(_increase(latest, earlier, "prefix_hits"), _increase(latest, earlier, "prefix_queries"))
                     for latest, earlier in standing if earlier]
        looked_up = [(hits, queries) for hits, queries in looked_up if hits is not None and queries is not None]
        queried = sum(queries for _, queries in looked_up)
        found.prefix_hit_percent.append(100.0 * min(sum(hits for hits, _ in looked_up) / queried, 1.0) if queried > 0 else None)
    return found


def _standing(read: list[tuple[list[Sample], list[float]]], *, at: float, hold: float) -> list[tuple[Sample, Sample | None]]:
    """Each copy read in the ``hold`` before ``at`` (``read``: each copy's samples and their times, in time
    order): its latest sample then, and the latest at least RATE_SPAN before that one (None when there is none
    in the hold)."""
    standing = []
    for rows, times in read:
        index = bisect.bisect_right(times, at) - 1
        if index < 0 or at - rows[index].at > hold:
            continue
        latest = rows[index]
        before = bisect.bisect_right(times, latest.at - RATE_SPAN) - 1
        standing.append((latest, rows[before] if before >= 0 and latest.at - rows[before].at <= hold else None))
    return standing


def _total(values) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _increase(latest: Sample, earlier: Sample, field: str) -> float | None:
    now, then = getattr(latest, field), getattr(earlier, field)
    if now is None or then is None:
        return None
    return now - then if now >= then else now  # it went down: the engine started again, counting from zero


def engine_charts(deployment, *, at: float | None = None) -> dict:
    """The engines' four charts; ``sampled``: whether any copy's engine was read in the hour."""
    now = time.time() if at is None else at
    samples = samples_of(deployment, now=now)
    found = engine_series(samples, now=now, hold=hold_seconds())
    recent = [s for s in samples if s.at >= now - MINUTES * 60]

    def empty(*fields: str, otherwise: str) -> str:
        if not recent:
            return "No figures from the engines yet"
        if all(getattr(s, f) is None for s in recent for f in fields):
            return "The engine does not report it"
        return otherwise

    def points(values) -> list:
        return list(zip(found.agos, values))

    tones = iter(COPY_TONES * 4)
    return {"sampled": bool(recent), "interval": settings.FADEN_HEALTH_INTERVAL, "off": settings.FADEN_ENGINE_METRICS_TIMEOUT <= 0, "charts": [
        charts.line_chart(title="Requests in the engines", unit="running and waiting",
                          series=[Series("Running", points(found.running), "accent"), Series("Waiting", points(found.waiting), "amber")],
                          empty=empty("running", "waiting", otherwise="No figures in the last hour")),
        charts.line_chart(title="Generation", unit="tokens per second",
                          series=[Series("Tokens/s", points(found.generation_per_second), "green")],
                          empty=empty("generation_tokens", otherwise="Not enough figures yet: a rate needs two checks")),
        charts.line_chart(title="KV-cache use", unit="percent of each copy's cache", fmt=charts.percent, top=100, area=False,
                          series=[Series(name, points(values), next(tones)) for name, values in found.kv_by_copy.items()],
                          empty=empty("kv_cache", otherwise="No figures in the last hour")),
        charts.line_chart(title="Prefix-cache hits", unit="percent of prompt tokens", fmt=charts.percent, top=100,
                          series=[Series("Hit rate", points(found.prefix_hit_percent), "blue")],
                          empty=empty("prefix_hits", "prefix_queries", otherwise="No prompts in the last hour")),
    ]}

