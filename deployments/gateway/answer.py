"""A forwarded request's answer as it goes back to the client, and the tokens its copy says it used.

``Answer`` takes the place of the client's ``send`` for one forwarded request (``app.py``) and keeps what the
metrics (``metrics.py``) and the key's limits and usage (``limits.py``) read once the answer has ended: the
status, when the first body bytes went (time to first token), whether it was a stream, and the last ``TAIL``
bytes of the body. The usage is there in every answer that carries one: after the choices (or the embeddings)
at the end of a whole answer, in OpenAI's shape and vLLM's, and in a stream's last event but ``[DONE]`` (when
the client asked for it, ``stream_options: {"include_usage": true}``). ``tokens()`` reads it once, for both.
"""
from __future__ import annotations

import json
import re
import time

TAIL = 8192  # bytes at the end of an answer kept to find its usage (between TAIL and 2 x TAIL are held)
_TWICE = 2 * TAIL  # the tail is cut back to TAIL past this: one cut per TAIL bytes, not one per chunk
USAGE_HELD = 4096  # bytes kept from the last "usage" seen in a chunk (a usage object is small)
TOKENS_MAX = 10**12  # a count past this in an answer is not believed (a copy's bug, or not a count at all)
_decoder = json.JSONDecoder()
_USAGE = re.compile(rb'"usage"\s*:\s*\{')
_PROMPT = re.compile(rb'"prompt_tokens"\s*:\s*([0-9]{1,15})\s*[,}]')
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*([0-9]{1,15})\s*[,}]')


class Answer:
    """The client's ``send``, passed on, noting what goes back. A plain call that returns the server's own
    awaitable: no coroutine of its own per chunk, and per chunk one append of a reference (no copy). Past
    ``2 x TAIL`` bytes the chunks are cut back to the last ``TAIL``, so a long stream costs no more memory than a
    short one; an answer that fits (most) is never copied or searched before ``tokens()``."""

    __slots__ = ("send", "status", "first_at", "streamed", "chunks", "size", "held", "_tokens")

    def __init__(self, send):
        self.send = send
        self.status: int | None = None  # None: no answer began (the client left, or the gateway failed first)
        self.first_at: float | None = None  # time.perf_counter() when the first body bytes went
        self.streamed = False  # text/event-stream
        self.chunks: list[bytes] = []  # the answer's end, at most 2 x TAIL bytes
        self.size = 0
        # The last usage in what was cut away, kept apart: vLLM writes prompt_logprobs after the usage of a whole
        # answer, and on a long prompt they push it out of the tail (a key's tokens limit would then count nothing).
        self.held = b""
        self._tokens: tuple[int, int] | None = None

    def __call__(self, message):
        body = message.get("body")
        if body:
            if self.first_at is None:
                self.first_at = time.perf_counter()
            self.chunks.append(body)
            self.size += len(body)
            if self.size > _TWICE:
                self._cut()
        elif body is None and message["type"] == "http.response.start":
            self.status = message["status"]
            for name, value in message.get("headers", ()):
                if name == b"content-type":
                    self.streamed = value.startswith(b"text/event-stream")
                    break
        return self.send(message)

    def _cut(self) -> None:
        """Keep the last TAIL bytes; the last usage in what goes (or across the cut) is held."""
        data = b"".join(self.chunks)
        at = data.rfind(b'"usage"', 0, len(data) - TAIL + len(b'"usage"') - 1)
        if at >= 0:
            self.held = data[at:at + USAGE_HELD]
        self.chunks, self.size = [data[-TAIL:]], TAIL

    @property
    def tail(self) -> bytes:
        """The answer's end kept: at least its last TAIL bytes (all of a shorter answer), at most 2 x TAIL."""
        return b"".join(self.chunks)

    def tokens(self) -> tuple[int, int]:
        """(prompt, completion) tokens the copy's answer says it used; (0, 0) for an answer that is not 2xx
        or says nothing (a stream the client did not ask usage for). Read once, however often asked."""
        if self._tokens is None:
            status = self.status
            if status is None or not 200 <= status < 300:
                self._tokens = (0, 0)
            else:
                tail = self.tail
                self._tokens = usage_of(self.held) if self.held and b'"usage"' not in tail else usage_of(tail)
        return self._tokens


def usage_of(data: bytes | bytearray) -> tuple[int, int]:
    """The last ``"usage": {...}`` object in an answer or a stream's events, as (prompt, completion) tokens.

    Only that object is parsed, not the answer: a JSON string cannot hold an unescaped ``"usage"``, so the
    last one found is the answer's own (after the choices in OpenAI's shape and vLLM's; a stream's final chunk,
    or with continuous usage the last chunk's, which counts them all). A ``null`` usage (OpenAI's chunks before
    the last) is passed over; (0, 0) when there is none."""
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


def _object_at(data: bytes | bytearray, start: int) -> dict | None:
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
