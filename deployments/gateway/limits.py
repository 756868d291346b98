"""Limits per key (requests and tokens a minute), enforced by every gateway process together, without a Redis
round trip on a request's path.

The window slides: a key's use "in the last minute" is this minute's count plus the minute before's, weighted
by how much of that minute is still inside the last 60 seconds (``previous * (1 - elapsed / 60) + current``,
as Cloudflare's and Kong's sliding windows count). Two counters a key, no log of requests, and no burst of
twice the limit across a minute's edge as a fixed window allows; the price is that it takes the minute before
as spread evenly (a burst at its start weighs until the window has fully moved past that minute).

Each process decides from its own memory (``Limits.admit``): the totals every process had counted at the last
flush, plus what it counted since. Every second the flush (``Limits.flush``, in the gateway's Redis thread)
adds what it counted to ``<prefix>:limits:<minute>`` (HINCRBY, fields ``<key id>:r`` and ``<key id>:t``) and
reads back that minute's and the one before's totals in the same round trip, so each process learns what the
others let through within a flush. The price is an overshoot: between two flushes a process does not see what
the others let through, so a key whose clients reach N processes may get up to (N - 1) x flush interval x its
rate a process past its limit (with one process, none). Tokens are known once an answer has ended (its
``usage``, answer.py): the tokens limit refuses the next requests once a minute's tokens are over.

A request refused is not counted against the limit (the window moves and lets it in again, as ``Retry-After``
says) and is answered 429 in OpenAI's shape: type ``requests`` or ``tokens``, code ``rate_limit_exceeded``.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass

from deployments.gateway.key_usage import KEEP_SECONDS as USAGE_KEEP_SECONDS
from deployments.gateway.key_usage import UsageCounts, usage_add
from deployments.gateway.routes import KeyEntry

log = logging.getLogger("fadenstack.gateway")

MINUTE = 60
KEEP_SECONDS = 3 * MINUTE  # a minute's hash in Redis: read for itself and as the minute before, then gone
KEEP_USAGE_HOURS = USAGE_KEEP_SECONDS // 3600  # usage a process keeps while Redis does not answer
EPSILON = 1e-9  # the weights are floats: a request waiting exactly Retry-After is let in


@dataclass(slots=True)
class Window:
    """One limited key's counts as this process knows them: this minute and the one before, every process's."""

    minute: int
    requests: int = 0
    tokens: int = 0
    previous_requests: int = 0
    previous_tokens: int = 0

    def move_to(self, minute: int) -> None:
        """A new minute: this one becomes the one before (or nothing, when a minute passed without a look)."""
        if minute <= self.minute:
            return
        if minute == self.minute + 1:
            self.previous_requests, self.previous_tokens = self.requests, self.tokens
        else:
            self.previous_requests = self.previous_tokens = 0
        self.minute, self.requests, self.tokens = minute, 0, 0


@dataclass(frozen=True)
class Refusal:
    """A 429: the body in OpenAI's shape and the headers (Retry-After in whole seconds)."""

    body: bytes
    headers: list[tuple[bytes, bytes]]
    retry_after: int
    kind: str  # "requests" or "tokens"
    message: str


def sliding(previous: int, current: int, elapsed: float) -> float:
    """A key's use over the last 60 s, ``elapsed`` seconds into this minute."""
    return previous * (1.0 - elapsed / MINUTE) + current


def wait_seconds(previous: int, current: int, elapsed: float, allowed: float) -> float:
    """Seconds until ``sliding`` comes down to ``allowed`` if nothing more comes: within this minute as the
    minute before weighs less, or (when this minute alone is over) into the next, where this one weighs."""
    if current <= allowed:
        if previous <= 0:
            return 0.0
        return max(0.0, (1.0 - (allowed - current) / previous) * MINUTE - elapsed)
    return (MINUTE - elapsed) + max(0.0, 1.0 - allowed / current) * MINUTE


class Limits:
    """One gateway process's windows and usage counts; ``admit`` and ``answered`` on the event loop only."""

    def __init__(self, *, clock=time.time):
        self.clock = clock
        self.windows: dict[int, Window] = {}  # limited key id -> its window
        self.pending: dict[tuple[int, int], list[int]] = {}  # (minute, key id) -> [requests, tokens] not yet flushed
        self.usage = UsageCounts()
        self.flush_error = ""

    # -- the request path --------------------------------------------------------------------------------

    def admit(self, key: KeyEntry) -> Refusal | None:
        """Count a request the gateway is about to send on, or refuse it (None: send it on)."""
        now = self.clock()
        figures = self.usage.figures(key.id, now)
        if not key.limited:
            figures.requests += 1
            return None
        minute = int(now // MINUTE)
        window = self.windows.get(key.id)
        if window is None:
            window = self.windows[key.id] = Window(minute)
        else:
            window.move_to(minute)
        elapsed = now - minute * MINUTE
        refusal = self._over(key, window, elapsed)
        if refusal is not None:
            figures.refused += 1
            return refusal
        figures.requests += 1
        window.requests += 1
        slot = self.pending.get((minute, key.id))
        if slot is None:
            self.pending[(minute, key.id)] = [1, 0]
        else:
            slot[0] += 1
        return None

    def _over(self, key: KeyEntry, window: Window, elapsed: float) -> Refusal | None:
        limit = key.requests_per_minute
        if limit is not None:
            used = sliding(window.previous_requests, window.requests, elapsed)
            if used + 1 > limit + EPSILON:
                wait = wait_seconds(window.previous_requests, window.requests, elapsed, limit - 1)
                return refusal("requests", limit, used, wait)
        limit = key.tokens_per_minute
        if limit is not None:
            used = sliding(window.previous_tokens, window.tokens, elapsed)
            if used > limit - 1 + EPSILON:  # the minute's tokens are used up (whole tokens: limit - 1 leaves one)
                wait = wait_seconds(window.previous_tokens, window.tokens, elapsed, limit - 1)
                return refusal("tokens", limit, used, wait)
        return None

    def answered(self, key: KeyEntry, tokens: tuple[int, int], *, error: bool) -> None:
        """An answer sent on (or failed): its error and its (prompt, completion) tokens (``Answer.tokens()``) to
        the key's usage, its tokens to its window."""
        prompt, completion = tokens
        now = self.clock()
        figures = self.usage.figures(key.id, now)
        figures.errors += error
        figures.prompt_tokens += prompt
        figures.completion_tokens += completion
        used = prompt + completion
        if key.limited and used:
            minute = int(now // MINUTE)
            window = self.windows.get(key.id)
            if window is None:
                window = self.windows[key.id] = Window(minute)
            window.move_to(minute)
            if window.minute == minute:
                window.tokens += used
            slot = self.pending.get((minute, key.id))
            if slot is None:
                self.pending[(minute, key.id)] = [0, used]
            else:
                slot[1] += used

    # -- the flush ----------------------------------------------------------------------------------------

    async def flush(self, run, client, prefix: str) -> None:
        """Add what this process counted to Redis and read back every process's totals, in one round trip in
        the Redis thread (``run(fn, *args)`` runs it there); counts that could not be written go with the next."""
        pending, self.pending = self.pending, {}
        usage, self.usage = self.usage, UsageCounts()
        minute = int(self.clock() // MINUTE)
        try:
            totals = await run(limits_write, client, prefix, pending, usage, minute)
        except Exception as exc:
            for slot, counts in pending.items():
                if slot[0] >= minute - 1:  # older minutes no longer weigh on any window
                    mine = self.pending.setdefault(slot, [0, 0])
                    mine[0] += counts[0]
                    mine[1] += counts[1]
            usage.merge(self.usage)
            usage.drop_before(int(self.clock() // 3600) - KEEP_USAGE_HOURS)  # Redis would have let them go by now
            self.usage = usage
            words = f"{type(exc).__name__}: {exc}"
            if words != self.flush_error:
                log.warning("The gateway could not share its keys' counts through Redis (each process limits by its "
                            "own until it can): %s", words)
            self.flush_error = words
            return
        if self.flush_error:
            log.info("The gateway shares its keys' counts through Redis again.")
        self.flush_error = ""
        self.apply(minute, totals)

    def apply(self, minute: int, totals: dict[int, dict[int, tuple[int, int]]]) -> None:
        """Every process's totals for ``minute`` and the one before, read at the flush, plus what this process
        counted since it began."""
        now_totals, before_totals = totals.get(minute, {}), totals.get(minute - 1, {})

        def known(at: int, key_id: int, table: dict) -> tuple[int, int]:
            read = table.get(key_id, (0, 0))
            since = self.pending.get((at, key_id), (0, 0))
            return read[0] + since[0], read[1] + since[1]

        for key_id in {*self.windows, *now_totals, *before_totals}:
            window = self.windows.get(key_id)
            if window is None:
                window = self.windows[key_id] = Window(minute)
            window.move_to(minute)
            if window.minute == minute:
                window.requests, window.tokens = known(minute, key_id, now_totals)
                window.previous_requests, window.previous_tokens = known(minute - 1, key_id, before_totals)
            elif window.minute == minute + 1:  # a request in the next minute came during the round trip
                window.previous_requests, window.previous_tokens = known(minute, key_id, now_totals)
            if not (window.requests or window.tokens or window.previous_requests or window.previous_tokens):
                del self.windows[key_id]  # a key not used for two minutes: nothing to remember


def limits_write(client, prefix: str, pending: dict, usage: UsageCounts, minute: int) -> dict:
    """In the Redis thread: add the counts (limits and usage) and read back this minute's and the one before's
    totals, in one pipeline. Returns {minute: {key id: (requests, tokens)}}."""
    pipe = client.pipeline(transaction=False)
    minutes = set()
    for (at, key_id), (requests, tokens) in pending.items():
        name = f"{prefix}:limits:{at}"
        if requests:
            pipe.hincrby(name, f"{key_id}:r", requests)
        if tokens:
            pipe.hincrby(name, f"{key_id}:t", tokens)
        minutes.add(at)
    for at in minutes:
        pipe.expire(f"{prefix}:limits:{at}", KEEP_SECONDS)
    usage_add(pipe, prefix, usage)
    pipe.hgetall(f"{prefix}:limits:{minute - 1}")
    pipe.hgetall(f"{prefix}:limits:{minute}")
    *_, before, now = pipe.execute()
    return {minute - 1: _totals(before), minute: _totals(now)}


def _totals(fields: dict) -> dict[int, tuple[int, int]]:
    found: dict[int, list[int]] = {}
    for name, value in fields.items():
        key_id, _, kind = name.decode().partition(":")
        if key_id.isdigit() and kind in ("r", "t"):
            found.setdefault(int(key_id), [0, 0])[kind == "t"] = int(value)
    return {key_id: (r, t) for key_id, (r, t) in found.items()}


# -- the refusal ----------------------------------------------------------------------------------------------


def refusal(kind: str, limit: int, used: float, wait: float) -> Refusal:
    """The 429 for a key over its ``kind`` limit: words that say which limit and when to come back."""
    seconds = max(1, math.ceil(wait))
    if kind == "requests":
        message = (f"Rate limit reached for this API key on requests per minute: it may make {limit:,} "
                   f"request{'s' if limit != 1 else ''} a minute and made {math.ceil(used):,} in the last minute. "
                   f"Try again in {seconds} s.")
    else:
        message = (f"Rate limit reached for this API key on tokens per minute: it may use {limit:,} tokens a minute "
                   f"(prompt and completion) and used {math.ceil(used):,} in the last minute. Try again in {seconds} s.")
    message += " An Operator sets the key's limits on the console's Gateway page."
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": "rate_limit_exceeded"}}).encode()
    headers = [(b"content-type", b"application/json"), (b"retry-after", str(seconds).encode()),
               (f"x-ratelimit-limit-{kind}".encode(), str(limit).encode()),
               (f"x-ratelimit-remaining-{kind}".encode(), b"0"),
               (f"x-ratelimit-reset-{kind}".encode(), f"{seconds}s".encode())]
    return Refusal(body=body, headers=headers, retry_after=seconds, kind=kind, message=message)
