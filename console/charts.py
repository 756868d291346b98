"""Line charts of the last hour, drawn on the server as SVG (templates/console/_line_chart.html): no script and
no style attribute, so the Content-Security-Policy stays as it is, and a chart re-renders like any card.

``line_chart`` turns series of points, each ``(seconds ago, value or None)``, into what the template draws:
the lines (a None breaks a line: a gap, where nothing was measured; a point alone between gaps is a dot),
the first series' area, the value axis from 0 to a round top with its labels in the chart's unit, the time
axis (1 h ago … now), the legend with each series' latest value, and one hover slot per point whose title
says every series' value then. The SVG keeps its proportions (its text is not stretched) and fills the
width of its box.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from console.templatetags.units import milliseconds, per_minute

SPAN = 3600  # seconds: the charts show the last hour
WIDTH, HEIGHT = 360, 124  # the viewBox
LEFT, RIGHT, TOP, BOTTOM = 42, 10, 8, 18  # room for the value labels on the left, the time labels below
TONES = ("accent", "amber", "green", "red", "blue", "grey")  # .chart__line--<tone> in console.css
_STEPS = (1, 2, 3, 4, 5, 6, 8, 10)  # round tops: their halves label the middle line


@dataclass(frozen=True)
class Series:
    name: str
    points: list[tuple[float, float | None]]  # (seconds ago, value), the oldest first
    tone: str = "accent"

    @property
    def latest(self) -> float | None:
        return next((value for _, value in reversed(self.points) if value is not None), None)


# -- units ----------------------------------------------------------------------------------------------


def number(value: float) -> str:
    """A count or a rate: ``0``, ``2.5``, ``42``, ``1.2 k``, ``2 k``, ``3.5 M``."""
    for size, suffix in ((1_000_000, "M"), (1000, "k")):
        if value >= size:
            return f"{value / size:.1f}".rstrip("0").rstrip(".") + f" {suffix}"
    return per_minute(value)


def percent(value: float) -> str:
    return f"{value:.0f}%" if value >= 10 or value == 0 else f"{value:.1f}%"


def ms(value: float) -> str:
    """A latency: ``0``, ``4.5 ms``, ``250 ms``, ``1.5 s``, ``10 s``."""
    if value == 0:
        return "0"
    if value < 1000:
        return milliseconds(value)
    return f"{value / 1000:.1f}".rstrip("0").rstrip(".") + " s"


def round_top(value: float) -> float:
    """The smallest round number (1, 2, 3, 4, 5, 6, 8 times a power of ten) at or above ``value``."""
    if value <= 0:
        return 1.0
    scale = 10 ** math.floor(math.log10(value))
    return next(step * scale for step in _STEPS if step * scale >= value * (1 - 1e-9))


def ago_words(seconds: float) -> str:
    minutes = round(seconds / 60)
    return "now" if minutes <= 0 else f"{minutes} min ago"


# -- the chart -----------------------------------------------------------------------------------------


def line_chart(*, title: str, unit: str, series: list[Series], fmt: Callable[[float], str] = number,
               top: float | None = None, empty: str = "No figures yet", area: bool = True) -> dict:
    """What templates/console/_line_chart.html draws. ``top``: a fixed top of the value axis (100 for a
    percentage); else the round number above the highest value. ``empty``: the words shown when no series
    has a value."""
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    values = [v for s in series for _, v in s.points if v is not None]
    fixed = top is not None
    top = top or round_top(max(values, default=0))

    def x_of(ago: float) -> float:
        return round(LEFT + (SPAN - min(max(ago, 0), SPAN)) / SPAN * plot_w, 2)

    def y_of(value: float) -> float:
        return round(TOP + plot_h - min(max(value, 0), top) / top * plot_h, 2)

    lines = []
    for index, one in enumerate(series):
        segments = _segments([(x_of(ago), None if v is None else y_of(v)) for ago, v in one.points if ago <= SPAN])
        lines.append({
            "tone": one.tone,
            "d": " ".join("M" + " L".join(f"{x},{y}" for x, y in seg) for seg in segments if len(seg) > 1),
            "area": " ".join(f"M{seg[0][0]},{TOP + plot_h} L" + " L".join(f"{x},{y}" for x, y in seg) + f" L{seg[-1][0]},{TOP + plot_h} Z"
                             for seg in segments if len(seg) > 1) if area and index == 0 else "",
            "dots": [seg[0] for seg in segments if len(seg) == 1],
        })
    return {
        "title": title, "unit": unit, "label": f"{title} ({unit}) over the last hour",
        "width": WIDTH, "height": HEIGHT, "plot": {"x": LEFT, "y": TOP, "w": plot_w, "h": plot_h, "right": LEFT + plot_w,
                                                  "bottom": TOP + plot_h, "label_x": LEFT - 6, "tick_y": HEIGHT - 4},
        # Without a value above 0 the axis has no scale to show: only its 0.
        "grid": [{"y": y_of(v), "label": fmt(v) if v == 0 or any(values) or fixed else ""} for v in (0, top / 2, top)],
        "ticks": [{"x": x_of(ago), "label": label, "anchor": anchor} for ago, label, anchor in
                  ((SPAN, "1 h ago", "start"), (2700, "45 min", "middle"), (1800, "30 min", "middle"),
                   (900, "15 min", "middle"), (0, "now", "end"))],
        "lines": lines,
        "legend": [{"name": s.name, "tone": s.tone, "latest": None if s.latest is None else fmt(s.latest)} for s in series],
        "slots": _slots(series, x_of, fmt) if values else [],
        "empty": None if values else empty,
    }


def _segments(points: list[tuple[float, float | None]]) -> list[list[tuple[float, float]]]:
    """The runs of measured points between gaps."""
    segments: list[list[tuple[float, float]]] = [[]]
    for x, y in points:
        if y is None:
            if segments[-1]:
                segments.append([])
        else:
            segments[-1].append((x, y))
    return [seg for seg in segments if seg]


def _slots(series: list[Series], x_of, fmt) -> list[dict]:
    """One hover area per point of time (the series share their times), as wide as halfway to each neighbour,
    titled with every series' value then."""
    agos = sorted({ago for s in series for ago, _ in s.points if 0 <= ago <= SPAN}, reverse=True)
    by_series = [dict(s.points) for s in series]
    xs = [x_of(ago) for ago in agos]
    slots = []
    for index, (ago, x) in enumerate(zip(agos, xs)):
        left = (xs[index - 1] + x) / 2 if index else LEFT
        right = (x + xs[index + 1]) / 2 if index + 1 < len(xs) else WIDTH - RIGHT
        said = [f"{s.name} {fmt(v)}" for s, points in zip(series, by_series) if (v := points.get(ago)) is not None]
        slots.append({"x": round(left, 2), "w": round(max(right - left, 0.5), 2),
                      "title": f"{ago_words(ago)}: {', '.join(said) if said else 'nothing measured'}"})
    return slots
