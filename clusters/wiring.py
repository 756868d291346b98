"""The cluster page's diagram: the head on the left, the others stacked on the right, a link from the
head to each carrying the last measured figure. Geometry only: the template does no arithmetic.
"""
from __future__ import annotations

from clusters.choices import Role

# The diagram's geometry, in SVG user units: the head on the left, the others stacked on the right,
# a curve from the head to each ending in a straight run that carries the measured figure.
WIRE_WIDTH = 860
HEAD_X, HEAD_W, HEAD_H = 16, 236, 104
WORKER_X, WORKER_W = 544, 300
LABEL_RUN = 150  # the straight end of each link, where its label sits
TOP = 48


def _node(view: dict, x: float, y: float, w: float, h: float, lines: list[float]) -> dict:
    """A box of the diagram with where its texts go (the template does no arithmetic)."""
    return {"view": view, "x": round(x), "y": round(y), "w": w, "h": h, "dot_x": round(x) + 18, "text_x": round(x) + 30,
            "sub_x": round(x) + 16, "right_x": round(x + w) - 12, "lines": [round(y + dy) for dy in lines]}


def wiring_diagram(views: list[dict]) -> dict:
    head = next((v for v in views if v["m"].role == Role.HEAD), None)
    workers = [v for v in views if v is not head]
    compact = len(workers) > 8  # up to ~20 machines stay on one screen
    box_h, gap, lines = (46, 10, [19, 36]) if compact else (58, 16, [24, 44])
    column = len(workers) * box_h + max(len(workers) - 1, 0) * gap
    body = max(column, HEAD_H)
    head_y = TOP + (body - HEAD_H) / 2
    x1, y1 = HEAD_X + HEAD_W, head_y + HEAD_H / 2
    nodes, links = [], []
    for i, view in enumerate(workers):
        y = TOP + (body - column) / 2 + i * (box_h + gap)
        nodes.append(_node(view, WORKER_X, y, WORKER_W, box_h, lines))
        x2, y2 = WORKER_X, round(y + box_h / 2)
        bend = x2 - LABEL_RUN
        middle = round((x1 + bend) / 2)
        link = view["link"]
        links.append({
            "d": f"M{x1},{round(y1)} C{middle},{round(y1)} {middle},{y2} {bend},{y2} L{x2},{y2}",
            "label_x": x2 - LABEL_RUN // 2 - 4, "label_y": y2,
            "mbps": link.mbps if link and link.mbps else None,
            "error": link.error if link and not link.mbps else "",
            "view": view,
        })
    return {
        "width": WIRE_WIDTH, "height": TOP + body + 12, "compact": compact,
        "head": _node(head, HEAD_X, head_y, HEAD_W, HEAD_H, [28, 50, 72, 92]) if head else None,
        "nodes": nodes, "links": links,
        "network_x": round((x1 + WORKER_X - LABEL_RUN) / 2), "alone_x": WORKER_X + WORKER_W // 2, "alone_y": round(y1),
    }
