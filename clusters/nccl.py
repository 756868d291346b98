"""The NCCL test's pure parts: reading nccl-tests' ``all_reduce_perf`` output, the sizes a sweep
runs, and how long the sizes not yet run would take (the slow link's sentence).

The parser reads what every nccl-tests version prints: ``#`` header lines, the column names
(``size count type [redop] [root] time algbw busbw #wrong|error time algbw busbw #wrong|error``), one
row per size, and at the end ``# Avg bus bandwidth``. It finds the columns by their names, so
older tables (no ``root``, an ``error`` magnitude instead of ``#wrong``, ``N/A`` when validation is
off) read like newer ones, and it skips what is not a row: NCCL's own INFO lines in between, mpirun's
``[1,0]<stdout>:`` tags, indentation from a pasted log. The lab's all-reduce prints the same format,
so one parser reads both.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

MiB = 1024 * 1024
GiB = 1024 * MiB
NCCL_TESTS_WARMUP = 5  # nccl-tests' defaults (-w, -n): what a run does per size unless told otherwise
NCCL_TESTS_ITERS = 20

_TAG = re.compile(r"^\[\d+,\d+\]<std(?:out|err)>:")  # mpirun --tag-output
_WRONG_NAMES = ("#wrong", "error", "wrong")
_AVG = re.compile(r"^#\s*Avg bus bandwidth\s*:\s*([0-9.eE+-]+)")
_BOUNDS = re.compile(r"^#\s*Out of bounds values\s*:\s*(\d+)")


class NcclOutputError(ValueError):
    """The text holds no all_reduce_perf table: the message says what was expected."""


@dataclass(frozen=True)
class SizeResult:
    """One message size: its bus bandwidth out of place and in place (GB/s, as nccl-tests prints
    them), the time of one out-of-place all-reduce (µs), and the wrong-value counts. A count is
    None where the run printed ``N/A`` (validation off) or an older nccl-tests' error magnitude."""

    size_bytes: int
    time_us: float
    busbw_out_of_place: float
    busbw_in_place: float
    wrong_out_of_place: int | None = None
    wrong_in_place: int | None = None
    time_in_place_us: float | None = None

    @property
    def busbw(self) -> float:
        """The better of the two: what the link carried at this size (the chart's point)."""
        return max(self.busbw_out_of_place, self.busbw_in_place)


@dataclass(frozen=True)
class AllReduceRun:
    """A parsed run. ``complete`` is False for a run cut short (no ``# Avg bus bandwidth`` line):
    its rows are the sizes that finished, usable for a partial chart and a projection."""

    rows: tuple[SizeResult, ...]
    complete: bool
    avg_busbw: float | None = None
    out_of_bounds: int | None = None

    @property
    def peak(self) -> SizeResult | None:
        """The size with the highest bus bandwidth (the first of equals), None without rows."""
        return max(self.rows, key=lambda r: r.busbw, default=None)

    @property
    def peak_busbw(self) -> float | None:
        return self.peak.busbw if self.rows else None


def _column_names(line: str) -> list[str] | None:
    """The header line naming the columns, as a list; None for any other line."""
    words = line.lstrip("#").split()
    if len(words) >= 7 and words[0] == "size" and words.count("busbw") == 2 and "time" in words:
        return words
    return None


@dataclass(frozen=True)
class _Columns:
    width: int
    size: int
    time: tuple[int, int]
    busbw: tuple[int, int]
    wrong: tuple[int, int] | None

    @classmethod
    def of(cls, names: list[str]) -> "_Columns":
        def both(name):
            found = [i for i, n in enumerate(names) if n == name]
            return (found[0], found[1]) if len(found) == 2 else None
        wrong = next((both(n) for n in _WRONG_NAMES if both(n)), None)
        time = both("time")
        if time is None:
            raise NcclOutputError(f"The all_reduce_perf header has no out-of-place and in-place time: {' '.join(names)}")
        return cls(width=len(names), size=names.index("size"), time=time, busbw=both("busbw"), wrong=wrong)


def _wrong(text: str) -> int | None:
    return int(text) if text.isdigit() else None  # N/A, or 0e+00 (older versions' max error, not a count)


def _row(words: list[str], columns: _Columns) -> SizeResult | None:
    if len(words) != columns.width or not words[columns.size].isdigit():
        return None
    try:
        time_oop, time_ip = (float(words[i]) for i in columns.time)
        busbw_oop, busbw_ip = (float(words[i]) for i in columns.busbw)
    except ValueError:
        return None  # a line that only looks like a row
    if not all(math.isfinite(v) for v in (time_oop, busbw_oop, busbw_ip)):
        return None
    wrong = (_wrong(words[columns.wrong[0]]), _wrong(words[columns.wrong[1]])) if columns.wrong else (None, None)
    return SizeResult(size_bytes=int(words[columns.size]), time_us=time_oop, busbw_out_of_place=busbw_oop,
                      busbw_in_place=busbw_ip, wrong_out_of_place=wrong[0], wrong_in_place=wrong[1],
                      time_in_place_us=time_ip if math.isfinite(time_ip) else None)


def parse_all_reduce(text: str) -> AllReduceRun:
    """Every size row of an ``all_reduce_perf`` output, in the order printed.

    Raises ``NcclOutputError`` when there is no table header at all (not nccl-tests' output, or it
    failed before measuring). A run cut short parses to the rows it printed, ``complete=False``.
    A header printed again (each MPI rank of a build without MPI prints its own) starts no new
    table: the rows go on.
    """
    columns: _Columns | None = None
    rows: list[SizeResult] = []
    avg = bounds = None
    for raw in text.splitlines():
        line = _TAG.sub("", raw).strip()
        if not line:
            continue
        if line.startswith("#"):
            names = _column_names(line)
            if names:
                columns = _Columns.of(names)
            elif match := _AVG.match(line):
                avg = float(match.group(1))
            elif match := _BOUNDS.match(line):
                bounds = int(match.group(1))
            continue
        if columns is not None and (row := _row(line.split(), columns)) is not None:
            rows.append(row)
    if columns is None:
        raise NcclOutputError("No all_reduce_perf table in the output: its header line (size, count, type, ... busbw) never came.")
    return AllReduceRun(rows=tuple(rows), complete=avg is not None, avg_busbw=avg, out_of_bounds=bounds)


# ------------------------------------------------------------------ sweeps and projections


def sizes(first: int = MiB, last: int = GiB) -> list[int]:
    """The message sizes of a sweep, doubling from ``first`` up to ``last`` (included when a
    doubling lands on it): 1 MiB to 1 GiB is 11 sizes, as ``all_reduce_perf -b 1M -e 1G -f 2`` runs."""
    if first <= 0 or last < first:
        raise ValueError(f"A sweep goes up from a positive size: got {first} to {last}.")
    out, size = [], first
    while size <= last:
        out.append(size)
        size *= 2
    return out


def projected_seconds(rows, remaining_sizes, *, warmup: int = NCCL_TESTS_WARMUP, iters: int = NCCL_TESTS_ITERS) -> float:
    """How long the sizes not yet run would take at the rate measured so far.

    The rate is the largest measured size's: bytes per second of one all-reduce, out of place and
    in place averaged (at the largest size the fixed cost per call weighs least, so larger sizes
    scale from it linearly). Each size runs ``warmup + iters`` times, out of place and in place.
    """
    measured = [r for r in rows if r.size_bytes > 0 and r.time_us > 0]
    if not measured:
        raise ValueError("No measured size to project from.")
    largest = max(measured, key=lambda r: r.size_bytes)
    times = [t for t in (largest.time_us, largest.time_in_place_us) if t]
    seconds_per_byte = sum(times) / len(times) / 1e6 / largest.size_bytes
    runs = 2 * (warmup + iters)
    return sum(size * seconds_per_byte * runs for size in remaining_sizes)


def should_stop(rows, remaining_sizes, *, elapsed_seconds: float, limit_seconds: float = 600, after_sizes: int = 5,
                warmup: int = NCCL_TESTS_WARMUP, iters: int = NCCL_TESTS_ITERS) -> bool:
    """True once ``after_sizes`` sizes have run and the rest would not finish within the limit:
    the test stops there and says so (``slow_link_sentence``) instead of running out the clock."""
    if len(rows) < after_sizes or not remaining_sizes:
        return False
    left = limit_seconds - elapsed_seconds
    return projected_seconds(rows, remaining_sizes, warmup=warmup, iters=iters) > left


def duration_words(seconds: float) -> str:
    """``about 14 minutes``: seconds under a minute and a half, minutes under an hour and a half, hours above."""
    if seconds < 90:
        n, unit = max(1, round(seconds)), "second"
    elif seconds < 90 * 60:
        n, unit = round(seconds / 60), "minute"
    else:
        n, unit = round(seconds / 3600), "hour"
    return f"about {n} {unit}{'' if n == 1 else 's'}"


def slow_link_sentence(sizes_done: int, link: tuple[str, str], seconds: float) -> str:
    """The sentence a test stopped on a slow link says: ``stopped after 5 sizes: the link between
    lab-a and lab-b would take about 14 minutes for the rest``."""
    return (f"stopped after {sizes_done} size{'' if sizes_done == 1 else 's'}: the link between {link[0]} and {link[1]}"
            f" would take {duration_words(seconds)} for the rest")
