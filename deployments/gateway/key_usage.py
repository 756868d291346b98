"""What each key used, per hour: counted in each gateway process's memory, added up in Redis.

On the request path (the event loop, no I/O): ``UsageCounts`` adds a request, a refusal, an error and the
tokens of an answer (read from the copy's ``usage`` by ``answer.py``) to the key's figures for the hour.

Every second the gateway's flush (``limits.py``) adds the counts to one Redis hash per hour,
``<prefix>:usage:<hour>`` (Unix hours; fields ``<key id>:<figure>``, kept ``KEEP_SECONDS``), and names the
hour in the set ``<prefix>:usage:dirty``. The console's beat task takes the dirty hours
(``usage_take``) and writes them to the database (``deployments/gateway_usage.py``), where they are kept
30 days: Redis is the meeting point of the gateways, not the record.
"""
from __future__ import annotations

from dataclasses import dataclass

FIGURES = ("requests", "errors", "refused", "prompt_tokens", "completion_tokens")
KEEP_SECONDS = 2 * 24 * 3600  # an hour's hash in Redis: long enough for a console stopped a day to catch up


def hour_of(at: float) -> int:
    return int(at // 3600)


@dataclass(slots=True)
class Figures:
    """One key's counts in one hour, since the last flush."""

    requests: int = 0
    errors: int = 0
    refused: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: Figures) -> None:
        for name in FIGURES:
            setattr(self, name, getattr(self, name) + getattr(other, name))


class UsageCounts:
    """What one gateway process counted since its last flush, per (hour, key id). Used on its event loop only."""

    def __init__(self):
        self.hours: dict[tuple[int, int], Figures] = {}

    def figures(self, key_id: int, at: float) -> Figures:
        slot = (hour_of(at), key_id)
        figures = self.hours.get(slot)
        if figures is None:
            figures = self.hours[slot] = Figures()
        return figures

    def merge(self, other: UsageCounts) -> None:
        """Counts a failed flush took back (they go with the next one)."""
        for slot, figures in other.hours.items():
            mine = self.hours.get(slot)
            if mine is None:
                self.hours[slot] = figures
            else:
                mine.add(figures)

    def drop_before(self, hour: int) -> None:
        self.hours = {slot: figures for slot, figures in self.hours.items() if slot[0] >= hour}

    def __bool__(self) -> bool:
        return bool(self.hours)


def usage_add(pipe, prefix: str, counts: UsageCounts) -> None:
    """Queue the HINCRBYs of ``counts`` on ``pipe`` (the flush's one round trip), and name the hours changed."""
    hours = set()
    for (hour, key_id), figures in counts.hours.items():
        name = f"{prefix}:usage:{hour}"
        for field in FIGURES:
            value = getattr(figures, field)
            if value:
                pipe.hincrby(name, f"{key_id}:{field}", value)
        hours.add(hour)
    for hour in hours:
        pipe.expire(f"{prefix}:usage:{hour}", KEEP_SECONDS)
    if hours:
        pipe.sadd(f"{prefix}:usage:dirty", *sorted(hours))


# -- the console's side -----------------------------------------------------------------------------------


def usage_take(client, prefix: str) -> dict[int, dict[int, dict[str, int]]]:
    """The hours some gateway counted in since the last take, each as {key id: {figure: total}}: the whole hour's
    totals (the database's row is set to them, not added to). The hours are taken off the dirty set first, so
    a gateway's flush after this read names its hour again; ``usage_untake`` puts them back when writing failed."""
    dirty = f"{prefix}:usage:dirty"
    pipe = client.pipeline(transaction=True)
    pipe.smembers(dirty)
    pipe.delete(dirty)
    members, _ = pipe.execute()
    hours = sorted(int(hour) for hour in members)
    if not hours:
        return {}
    pipe = client.pipeline(transaction=False)
    for hour in hours:
        pipe.hgetall(f"{prefix}:usage:{hour}")
    taken: dict[int, dict[int, dict[str, int]]] = {}
    try:
        answers = pipe.execute()
    except Exception:
        usage_untake(client, prefix, hours)
        raise
    for hour, fields in zip(hours, answers):
        keys: dict[int, dict[str, int]] = {}
        for name, value in fields.items():
            key_id, _, figure = name.decode().partition(":")
            if figure in FIGURES and key_id.isdigit():
                keys.setdefault(int(key_id), {})[figure] = int(value)
        if keys:
            taken[hour] = keys
    return taken


def usage_untake(client, prefix: str, hours) -> None:
    """The hours named dirty again: the next take reads them once more."""
    hours = list(hours)
    if hours:
        client.sadd(f"{prefix}:usage:dirty", *hours)
