"""Request bodies read within bounds: a size, and a depth of nesting for JSON.

Python's json parser recurses once per level of nesting, so ``[[[[...]]]]`` a few thousand levels
deep raises RecursionError (not ValueError) and, below that, leaves a document that every
serializer and error formatter after it recurses through again. No request to the console nests
deeper than a few levels, so anything past ``MAX_DEPTH`` is refused as it is read. The API
(``console.api.JSONParser``) and the machines' heartbeat read bodies through here.
"""
from __future__ import annotations

import json

MAX_DEPTH = 32


class BodyRefused(Exception):
    """A body the console will not read: ``status`` is 413 when too large, else 400."""

    def __init__(self, message: str, *, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


def read_bounded(stream, *, limit: int) -> bytes:
    """At most ``limit`` bytes of ``stream``; BodyRefused (413) when it holds more."""
    raw = stream.read(limit + 1)
    if len(raw) > limit:
        raise too_large(limit)
    return raw


def json_loads(raw: bytes, *, max_depth: int = MAX_DEPTH) -> object:
    """The JSON document in ``raw`` (UTF-8), nested at most ``max_depth`` levels; BodyRefused otherwise.

    NaN and Infinity are refused, as strict JSON has neither.
    """
    try:
        document = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except RecursionError:
        raise _too_deep(max_depth) from None
    except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError among them
        raise BodyRefused(f"The body is not JSON: {exc}.") from None
    if depth_exceeds(document, max_depth):
        raise _too_deep(max_depth)
    return document


def depth_exceeds(document: object, limit: int) -> bool:
    """Whether lists and objects nest deeper than ``limit`` in ``document``; without recursion, and
    stopping at the first container past the limit."""
    stack = [(document, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def too_large(limit: int) -> BodyRefused:
    """A body past ``limit`` bytes (the API's parser, the heartbeat, and Django's own limit on forms)."""
    return BodyRefused(f"The request body is larger than the {limit:,} bytes the console accepts.", status=413)


def _too_deep(limit: int) -> BodyRefused:
    return BodyRefused(f"The JSON body nests deeper than {limit} levels of lists and objects.")


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")
