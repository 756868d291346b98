"""What each key used, per hour: counted in each gateway process's memory, added up in Redis, and the tokens
read from the copies' answers.

On the request path (the event loop, no I/O): ``UsageCounts`` adds a request, a refusal, an error and the
tokens of an answer to the key's figures for the hour; ``AnswerTap`` sits between the gateway and the
client's ``send`` and keeps what it needs to read the answer's ``usage`` once it was sent: the whole of an
answer that is not streamed, the last ``STREAM_TAIL`` bytes of a stream (where the copy puts its usage when
the client asked for it, ``stream_options: {"include_usage": true}``).

Every second the gateway's flush (``limits.py``) adds the counts to one Redis hash per hour,
``<prefix>:usage:<hour>`` (Unix hours; fields ``<key id>:<figure>``, kept ``KEEP_SECONDS``), and names the
hour in the set ``<prefix>:usage:dirty``. The console's beat task takes the dirty hours
(``usage_take``) and writes them to the database (``deployments/gateway_usage.py``), where they are kept
30 days: Redis is the meeting point of the gateways, not the record.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

FIGURES = ("requests", "errors", "refused", "prompt_tokens", "completion_tokens")
KEEP_SECONDS = 2 * 24 * 3600  # an hour's hash in Redis: long enough for a console stopped a day to catch up
STREAM_TAIL = 8192  # bytes of a stream kept to find its usage (the last event but [DONE])
TOKENS_MAX = 10**12  # a count past this in an answer is not believed (a copy's bug, or not a count at all)
_decoder = json.JSONDecoder()
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*([0-9]{1,15})\s*[,}]')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*([0-9]{1,15})\s*[,}]')


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


# -- the answer's usage ---------------------------------------------------------------------------------------


class AnswerTap:
    """Passes every message on to the client's ``send`` and keeps what ``tokens()`` needs: the status, and the
    body (whole) or the stream's tail. Costs the request path a call and an append per chunk."""

    __slots__ = ("_send", "status", "streamed", "chunks", "tail")

    def __init__(self, send):
        self._send = send
        self.status = 0
        self.streamed = False
        self.chunks: list[bytes] = []
        self.tail = bytearray()

    async def send(self, message) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            chunk = message.get("body")
            if chunk:
                if self.streamed:
                    tail = self.tail
                    tail += chunk
                    if len(tail) > 2 * STREAM_TAIL:
                        del tail[:-STREAM_TAIL]
                else:
                    self.chunks.append(chunk)
        elif kind == "http.response.start":
            self.status = message["status"]
            for name, value in message.get("headers", ()):
                if name == b"content-type":
                    self.streamed = value.startswith(b"text/event-stream")
                    break
        await self._send(message)

    def tokens(self) -> tuple[int, int]:
        """(prompt, completion) tokens the copy's answer says it used; (0, 0) when it says nothing (an error,
        a stream the client did not ask usage for)."""
        if not 200 <= self.status < 300:
            return 0, 0
        return usage_of(bytes(self.tail) if self.streamed else b"".join(self.chunks))


def usage_of(data: bytes) -> tuple[int, int]:
    """The last ``"usage": {...}`` object in an answer or a stream's events, as (prompt, completion) tokens.

    Only that object is parsed, not the answer: the gateway reads every answer, and a JSON string cannot hold
    an unescaped ``"usage"``, so the last one found is the answer's own (after the choices in OpenAI's shape
    and vLLM's; a stream's final chunk, or with continuous usage the last chunk's, which counts them all).
    A ``null`` usage (OpenAI's chunks before the last) is passed over."""
    end = len(data)
    while (at := data.rfind(b'"usage"', 0, end)) >= 0:
        end = at
        opened = _USAGE.match(data, at)
        if opened is None:
            continue  # null, or not the object
        start = opened.end() - 1
        # The counts come before any object inside usage (OpenAI's *_details, vLLM's prompt_tokens_details): read
        # them up to the first "}" without parsing JSON; parse the object only when they are not both there.
        close = data.find(b"}", start, start + 4096) + 1
        if close:
            prompt = _PROMPT.search(data, start, close)
            completion = _COMPLETION.search(data, start, close)
            if prompt is not None and (completion is not None or data.find(b'"completion_tokens"', start, close) < 0):
                return _count(int(prompt[1])), _count(int(completion[1])) if completion is not None else 0
        usage = _object_at(data, start)
        if usage is None:
            continue
        return _counts(usage)
    return 0, 0


def _object_at(data: bytes, start: int) -> dict | None:
    """The JSON object starting at ``start``: read from its first 4 KiB (usage objects are small), else from
    the rest; None when it does not parse (cut short, or not JSON)."""
    for piece in (data[start:start + 4096], data[start:]):
        try:
            value, _ = _decoder.raw_decode(piece.decode("utf-8", "replace"))
        except ValueError:
            if len(piece) < 4096:
                return None
            continue
        return value if isinstance(value, dict) else None
    return None


def _count(value: int) -> int:
    return value if value <= TOKENS_MAX else 0


def _counts(usage) -> tuple[int, int]:
    def count(name: str) -> int:
        value = usage.get(name) if isinstance(usage, dict) else None
        return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= TOKENS_MAX else 0

    return count("prompt_tokens"), count("completion_tokens")


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
