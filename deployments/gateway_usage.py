"""The keys' usage per hour in the console: copied from Redis, where the gateway processes add it up
(``deployments/gateway/key_usage.py``), to ``KeyUsage`` rows, read by the Gateway page and the API.

A beat task (``deployments.tasks.gateway_usage_copy``, every FADEN_GATEWAY_USAGE_TICK seconds) takes the hours
some gateway counted in since its last run and sets their rows to Redis's totals: setting, not adding, so a
run repeated (or two at once) writes the same figures. The rows are kept FADEN_KEEP_KEY_USAGE_DAYS (30) by the
console's pruning. Why the database and not Redis alone: Redis is where the gateways meet, and this console
treats it as something it can lose (``make run`` makes a new one; a backup leaves it out); the rows are kept
with the keys, for 30 days of hours at a few rows per key an hour.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from django.conf import settings
from django.utils import timezone

from deployments.gateway import key_usage, traffic
from deployments.models import GatewayKey, KeyUsage

log = logging.getLogger(__name__)

HOURS_MAX = 30 * 24  # what the API gives at most: the hours kept
FIGURES = key_usage.FIGURES


def usage_copy(*, client=None, prefix: str | None = None) -> int:
    """Write the hours the gateways counted in since the last run to the database; the rows written."""
    if client is None:
        client, prefix = traffic.redis_client(settings.REDIS_URL), settings.FADEN_GATEWAY_REDIS_PREFIX
    taken = key_usage.usage_take(client, prefix)
    if not taken:
        return 0
    try:
        known = set(GatewayKey.objects.filter(pk__in={pk for keys in taken.values() for pk in keys})
                    .values_list("pk", flat=True))
        rows = [KeyUsage(key_id=pk, hour=datetime.fromtimestamp(hour * 3600, UTC),
                         **{name: figures.get(name, 0) for name in FIGURES})
                for hour, keys in taken.items() for pk, figures in keys.items() if pk in known]
        KeyUsage.objects.bulk_create(rows, update_conflicts=True, unique_fields=["key", "hour"], update_fields=list(FIGURES),
                                     batch_size=1000)
    except Exception:
        key_usage.usage_untake(client, prefix, taken)  # the next run reads these hours again
        raise
    return len(rows)


def usage_prune(older_than: datetime) -> int:
    """Hours older than the days kept (console.pruning's registry)."""
    from console.pruning import delete_in_batches

    return delete_in_batches(KeyUsage.objects.filter(hour__lt=older_than))


# -- what the page and the API read -------------------------------------------------------------------------------


@dataclass
class DayUsage:
    """A key's last 24 hours: the totals and requests per hour (oldest first, this hour last)."""

    requests: int = 0
    errors: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    per_hour: list[int] = field(default_factory=lambda: [0] * 24)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def spark(self) -> list[dict]:
        """The bars of requests per hour, in a 0..100 x 0..24 box (drawn as SVG, as the traffic's sparkline)."""
        top = max(self.per_hour) or 1
        width = 100 / len(self.per_hour)
        bars = []
        for index, count in enumerate(self.per_hour):
            height = round(max(24 * count / top, 1 if count else 0), 2)
            bars.append({"x": round(index * width, 2), "w": round(width * 0.7, 2), "h": height, "y": round(24 - height, 2),
                         "n": count, "ago": len(self.per_hour) - 1 - index})
        return bars


def hour_start(at: datetime) -> datetime:
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def usage_last_day(key_ids, *, now: datetime | None = None) -> dict[int, DayUsage]:
    """Each key's last 24 hours (this hour and the 23 before), in one query."""
    ids = list(key_ids)
    found = {pk: DayUsage() for pk in ids}
    if not ids:
        return found
    this_hour = hour_start(now or timezone.now())
    first = this_hour - timedelta(hours=23)
    for row in KeyUsage.objects.filter(key_id__in=ids, hour__gte=first, hour__lte=this_hour).values("key_id", "hour", *FIGURES):
        day = found[row["key_id"]]
        for name in FIGURES:
            setattr(day, name, getattr(day, name) + row[name])
        day.per_hour[int((row["hour"] - first).total_seconds() // 3600)] += row["requests"]
    return found


def usage_hours(key: GatewayKey, *, hours: int = 24, now: datetime | None = None) -> dict:
    """The key's last ``hours`` hours, each with its figures (zero when it did nothing), oldest first, and their
    totals: what ``/api/gateway/keys/<id>/usage/`` answers."""
    this_hour = hour_start(now or timezone.now())
    first = this_hour - timedelta(hours=hours - 1)
    rows = {row["hour"]: row for row in KeyUsage.objects.filter(key=key, hour__gte=first, hour__lte=this_hour)
            .values("hour", *FIGURES)}
    listed = []
    for index in range(hours):
        hour = first + timedelta(hours=index)
        row = rows.get(hour, {})
        listed.append({"hour": hour, **{name: row.get(name, 0) for name in FIGURES}})
    return {"key": key.pk, "from": first, "to": this_hour + timedelta(hours=1), "hours": listed,
            "total": {name: sum(hour[name] for hour in listed) for name in FIGURES}}
