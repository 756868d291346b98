"""Agent versions: which of two is newer, and whether a machine's agent is older than the console's.

Pure: the shipped version is passed in (``machines.agent.agent_version`` reads it from the agent's
VERSION file). Versions compare by their numbers (0.10.0 is newer than 0.9.0, which a string
comparison gets wrong); a version the console cannot read (empty: never reported) counts as out of
date, since nothing says the machine has what the drivers and the heartbeat need.
"""
from __future__ import annotations

import re

# "0.3.0", "0.3", "1.2.3rc1", "0.3.0-dev": the numbers, then anything else marks a pre-release.
_VERSION = re.compile(r"(\d{1,9}(?:\.\d{1,9}){0,3})(.*)")


def version_key(version: str) -> tuple[tuple[int, ...], int] | None:
    """A key that orders versions as releases do, or None when ``version`` is not one.

    ``0.3`` equals ``0.3.0``; a pre-release (``0.3.0rc1``, ``0.3.0-dev``) comes before its release.
    """
    match = _VERSION.fullmatch(version.strip()) if version else None
    if match is None:
        return None
    numbers = [int(part) for part in match.group(1).split(".")]
    numbers += [0] * (4 - len(numbers))
    return tuple(numbers), 0 if match.group(2) else 1


def agent_outdated(installed: str, shipped: str) -> bool:
    """Whether an agent reporting ``installed`` is older than ``shipped``; unknown counts as older.

    A machine with a newer agent than the console's (a console rolled back) is not out of date:
    installing the console's would be a downgrade.
    """
    have, want = version_key(installed), version_key(shipped)
    if have is None:
        return True
    if want is None:
        return False  # the console cannot read its own version: claim nothing about the machine's
    return have < want
