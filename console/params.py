"""Ids, numbers and words from a request, parsed strictly: ids and numbers in the digits 0-9 only,
within the database's range; each parameter given once.

Python's ``int()`` is generous where a request must not be: it reads ``"١٢"`` (Arabic-Indic digits)
as 12, and raises on ``"²"`` (which ``str.isdigit`` accepts) and on numbers longer than 4,300 digits;
the database then refuses ids past its bigint range (SQLite with an OverflowError, PostgreSQL with a
DataError). So every id, list of ids and number that a page, the API or the live socket takes from
a path, query string, form or body goes through here, and a bad one is a 400 that says what was
wrong (``console.errors`` for pages, ``console.api`` for the API), never a 500.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

from django.core.exceptions import BadRequest

# Every primary key is a bigint (DEFAULT_AUTO_FIELD), in SQLite and PostgreSQL alike.
ID_MAX = 2**63 - 1
# Ids in one request: more machines than one console holds (ARCHITECTURE.md: a few thousand at most),
# and few enough for one ``IN (...)`` in every database.
MAX_IDS = 5000
_DIGITS = re.compile(r"[0-9]{1,19}")  # not \d, which matches every script's digits


class InvalidParameter(BadRequest):
    """A parameter that is not what it should be: a 400 naming it, on a page or in the API."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


def shown(raw: object, limit: int = 24) -> str:
    """The value as the refusal quotes it: in quotes, and cut short when long."""
    text = str(raw)
    if len(text) > limit:
        return f"{text[:limit]!r}… ({len(text):,} characters)"
    return repr(text)


def parse_int(raw: object, *, name: str, low: int = 1, high: int = ID_MAX) -> int:
    """``raw`` (a str, or an int from JSON) as an int from ``low`` to ``high``, or InvalidParameter."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        value = raw
    elif isinstance(raw, str) and _DIGITS.fullmatch(raw.strip()):
        value = int(raw)
    else:
        value = None
    if value is None or not low <= value <= high:
        raise InvalidParameter(name, f"Give a whole number from {low:,} to {high:,} in the digits 0-9, not {shown(raw)}.")
    return value


def _given_once(query, name: str) -> str:
    """``query[name]`` stripped, "" when absent; a parameter given twice (``?page=2&page=``) is refused,
    as nothing says which one was meant."""
    given = query.getlist(name)
    if len(given) > 1:
        raise InvalidParameter(name, f"Give one value, not {len(given)}.")
    return given[0].strip() if given else ""


def int_param(query, name: str, *, default: int | None = None, low: int = 1, high: int = ID_MAX) -> int | None:
    """The number ``query[name]`` names (a query string or a form); ``default`` when it is absent or
    blank (a form's empty field)."""
    raw = _given_once(query, name)
    return parse_int(raw, name=name, low=low, high=high) if raw else default


def text_param(query, name: str, *, max_length: int = 100) -> str:
    """The words ``query[name]`` holds for a search (``?q=gpu``), cut to ``max_length``; "" when absent.
    Without NUL, which PostgreSQL refuses in any string."""
    text = _given_once(query, name)[:max_length]
    if "\x00" in text:
        raise InvalidParameter(name, "Give text without NUL characters.")
    return text


def choice_param(query, name: str, choices) -> str:
    """The value ``query[name]`` names, one of ``choices``; "" when it is absent or blank."""
    value = _given_once(query, name)
    if value and value not in choices:
        raise InvalidParameter(name, f"Give one of {', '.join(choices)}, not {shown(value)}.")
    return value


def id_list(values: Iterable[object], *, name: str) -> list[int]:
    """The ids in ``values``: repeated parameters, comma-separated ones (``?machines=3,4&machines=5``)
    or both; each strict, in the order given, once each. Blank parts are skipped (a trailing comma)."""
    parts = [part for value in values for part in (value.split(",") if isinstance(value, str) else [value])
             if not (isinstance(part, str) and not part.strip())]
    if len(parts) > MAX_IDS:
        raise InvalidParameter(name, f"Give at most {MAX_IDS:,} ids at once; this request has {len(parts):,}.")
    return list(dict.fromkeys(parse_int(part, name=name) for part in parts))


class IdConverter:
    """``<id:pk>`` in a URL: an id the database can hold. Anything else matches no URL (a 404), as no
    object could have it."""

    regex = "[0-9]{1,19}"

    def to_python(self, value: str) -> int:
        number = int(value)
        if not 1 <= number <= ID_MAX:
            raise ValueError(value)  # Django reads a ValueError here as "this URL does not match"
        return number

    def to_url(self, value: int) -> str:
        return str(value)
