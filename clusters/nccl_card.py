"""The NCCL test card of the cluster's page: the button (with a confirmation step while copies
serve), the sizes of the last test as they finish, its chart of bus bandwidth by size (an inline
SVG drawn here, a log2 axis of sizes, the peak marked and named) and how it ended.

Drawn by the page among the registered cards (clusters/apps.py), alone by a live push of the
cluster's topic, part ``nccl`` (clusters/nccl_tests.py pushes it after each size and at the end), and
with the members' and the whole page's pushes (``render_nccl_card``), so its button follows the cluster.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from django.conf import settings
from django.template.loader import render_to_string

from clusters import hooks, nccl, nccl_tests
from clusters.models import Cluster, NcclTest, NcclTestState
from console import roles

# The chart's frame, in the SVG's own units (it scales to the card's width).
WIDTH, HEIGHT = 640, 240
LEFT, RIGHT, TOP, BOTTOM = 56, 40, 28, 40
Y_TICKS = 4


@dataclass(frozen=True)
class Point:
    x: float
    y: float
    size: str  # 64 MiB
    busbw: float
    peak: bool


def nice_ceiling(value: float) -> float:
    """The axis' top: a round number at or above ``value`` (1, 1.5, 2, 2.5, 3, 4, 5, 6 or 8 times a power
    of ten), so that the highest point sits near the top rather than halfway up."""
    if value <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(value))
    return next(step * power for step in (1, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if step * power >= value * (1 - 1e-9))


def chart(rows: list[dict], planned: list[int]) -> dict | None:
    """The chart's geometry: every planned size on a log2 axis (so a running test's axis does not
    move), a point per measured size, the bus bandwidth axis from 0 to a round top; None without rows."""
    if not rows:
        return None
    sizes = sorted({*planned, *(row["size_bytes"] for row in rows)})
    low, high = math.log2(sizes[0]), math.log2(sizes[-1])
    span_x, span_y = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top = nice_ceiling(max(row["busbw"] for row in rows) * 1.1)

    def x_of(size: int) -> float:
        return round(LEFT + (span_x * (math.log2(size) - low) / (high - low) if high > low else span_x / 2), 1)

    def y_of(busbw: float) -> float:
        return round(TOP + span_y * (1 - busbw / top), 1)

    peak = max(rows, key=lambda row: row["busbw"])
    points = [Point(x=x_of(r["size_bytes"]), y=y_of(r["busbw"]), size=nccl_tests.size_words(r["size_bytes"]),
                    busbw=r["busbw"], peak=r is peak) for r in rows]
    every = 1 if len(sizes) <= 8 else 2  # labels of 11 sizes would touch: every other one
    x_ticks = [{"x": x_of(size), "label": nccl_tests.size_words(size) if i % every == 0 or size == sizes[-1] else ""}
               for i, size in enumerate(sizes)]
    y_ticks = [{"y": y_of(top * i / Y_TICKS), "label": f"{top * i / Y_TICKS:.3g}"} for i in range(Y_TICKS + 1)]
    marked = next(p for p in points if p.peak)
    return {
        "width": WIDTH, "height": HEIGHT, "left": LEFT, "right": WIDTH - RIGHT, "top": TOP, "bottom": HEIGHT - BOTTOM,
        "points": points, "line": " ".join(f"{p.x},{p.y}" for p in points), "x_ticks": x_ticks, "y_ticks": y_ticks,
        "peak": marked, "peak_label": nccl_tests.peak_words(peak),
        # The peak's label sits above its point, kept inside the frame.
        "peak_label_x": min(max(marked.x, LEFT + 90), WIDTH - RIGHT - 90), "peak_label_y": max(marked.y - 10, 12),
    }


def table_rows(rows: list[dict]) -> list[dict]:
    peak = max(rows, key=lambda row: row["busbw"], default=None)
    return [{**row, "size": nccl_tests.size_words(row["size_bytes"]), "peak": row is peak,
             "algbw_text": nccl_tests.gb_words(row["algbw"]), "busbw_text": nccl_tests.gb_words(row["busbw"])} for row in rows]


def planned_sizes(test: NcclTest) -> list[int]:
    return nccl.sizes(test.minbytes, test.maxbytes)


def nccl_card(cluster: Cluster, role: roles.Role | None) -> dict:
    """The card's context: the button's offer for ``role``, the serving copies that ask for
    confirmation, and the last test with its rows and chart."""
    test = NcclTest.objects.filter(cluster=cluster).select_related("started_by").first()
    offer = nccl_tests.nccl_test_offer(cluster, role)
    copies = hooks.serving_copies(cluster) if offer.ok else 0
    planned = planned_sizes(test) if test else nccl_tests.sweep_sizes()
    return {"nccl": {
        "offer": offer,
        "confirm": nccl_tests.serving_warning(cluster, copies) if copies else "",
        "test": test,
        "running": test is not None and test.state == NcclTestState.RUNNING,
        "rows": table_rows(test.rows) if test else [],
        "chart": chart(test.rows, planned) if test else None,
        "sizes_planned": len(planned),
        "sweep": f"{nccl_tests.size_words(planned[0])} to {nccl_tests.size_words(planned[-1])}",
        "peak": nccl_tests.peak_words(test.peak) if test and test.rows else "",
        "limit": nccl_tests.limit_words(settings.FADEN_NCCL_TEST_LIMIT_SECONDS),
    }}


def render_nccl_card(page: dict) -> str:
    """The card pushed with the members and the whole page (a machine Up, the cluster Running), so that its
    button follows the cluster, from the context the page's push renders already (``extra_cards``)."""
    return render_to_string("clusters/_nccl_card.html",
                            {"cluster": page["cluster"], "role": page["role"], "nccl": page["nccl"], "oob": True})
