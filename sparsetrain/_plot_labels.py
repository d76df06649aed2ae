"""Labels beside plotted points that never overlap: :func:`place_labels` finds a box for each label (pure
geometry, display units), :func:`label_points` measures matplotlib texts and puts them there."""
from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

Box = tuple[float, float, float, float]   # x0, y0, x1, y1 in display units (pixels)

# Directions tried around a point, in order: upper right first, then the other diagonals and sides, then
# the directions between them.
_ANGLES = (45, 0, 90, -45, 135, 180, -90, -135, 22.5, 67.5, 112.5, 157.5, -22.5, -67.5, -112.5, -157.5)


def place_labels(anchors: Sequence[tuple[float, float]], sizes: Sequence[tuple[float, float]],
                 obstacles: Sequence[Box] = (), bounds: Box | None = None, gap: float = 2.0,
                 rings: int = 40) -> list[Box]:
    """A box for each label, near its anchor, no two boxes (nor a box and an obstacle) closer than `gap`.

    Deterministic: labels are placed in the order given, each at the first free candidate of a fixed sequence:
    rings of growing radius around the anchor (one step = 0.75 x the label's height), 16 directions per ring,
    upper right first. For the first `rings` rings a candidate must lie inside `bounds`; after that anywhere,
    which always ends: far enough out nothing is in the way.

    Example:
        >>> place_labels([(10, 10), (10, 10)], [(30, 10), (30, 10)])   # upper right, then lower right
        [(12.0, 12.0, 42.0, 22.0), (12.0, -2.0, 42.0, 8.0)]
    """
    import numpy as np

    taken = np.asarray(obstacles, dtype=float).reshape(-1, 4)
    # a direction's unit offsets, stretched to the square: at least one side of the box clears the anchor
    angles = np.deg2rad(_ANGLES)
    cos, sin = (np.clip(np.sqrt(2) * f(angles), -1, 1) for f in (np.cos, np.sin))
    placed: list[Box] = []
    for (x, y), (w, h) in zip(anchors, sizes, strict=True):
        step = 0.75 * max(h, 1.0)
        for ring in itertools.count():
            radius = gap + ring * step
            # the box's nearest side (a diagonal: its corner) lies `radius` from the anchor
            cx, cy = x + cos * (w / 2 + radius), y + sin * (h / 2 + radius)
            boxes = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], axis=1)
            free = ~((boxes[:, None, 0] < taken[None, :, 2] + gap) & (taken[None, :, 0] < boxes[:, None, 2] + gap)
                     & (boxes[:, None, 1] < taken[None, :, 3] + gap)
                     & (taken[None, :, 1] < boxes[:, None, 3] + gap)).any(axis=1)
            if bounds is not None and ring < rings:
                free &= ((boxes[:, 0] >= bounds[0]) & (boxes[:, 1] >= bounds[1]) & (boxes[:, 2] <= bounds[2])
                         & (boxes[:, 3] <= bounds[3]))
            if free.any():
                box = boxes[int(np.argmax(free))]
                break
        taken = np.vstack([taken, box])
        placed.append(tuple(float(v) for v in box))
    return placed


def label_points(fig, ax, items: Sequence[tuple[float, float, str, str]], marker_px: float) -> list:
    """Annotate `items` (x, y, text, colour in data units) on `ax` without overlaps: measure each text, place the
    boxes with :func:`place_labels` in display units (the markers as obstacles), then put each text there, with a
    thin leader line when it ended up away from its point. Call it once the figure's layout is final."""
    renderer = fig.canvas.get_renderer()
    anchors = [tuple(ax.transData.transform((x, y))) for x, y, _, _ in items]
    sizes = []
    for _, _, text, _ in items:
        probe = ax.text(0, 0, text, fontsize=7)
        extent = probe.get_window_extent(renderer)
        sizes.append((extent.width, extent.height))
        probe.remove()
    half = marker_px / 2
    obstacles = [(x - half, y - half, x + half, y + half) for x, y in anchors]
    bbox = ax.get_window_extent(renderer)
    boxes = place_labels(anchors, sizes, obstacles, bounds=(bbox.x0, bbox.y0, bbox.x1, bbox.y1))
    to_points = 72.0 / fig.dpi
    near = half + 2.0 + 0.75 * max((h for _, h in sizes), default=0)
    annotations = []
    for (x, y, text, color), (ax_, ay_), box in zip(items, anchors, boxes):
        gap_x = max(box[0] - ax_, ax_ - box[2], 0.0)
        gap_y = max(box[1] - ay_, ay_ - box[3], 0.0)
        arrow = (dict(arrowstyle="-", lw=0.5, color=color, alpha=0.6, shrinkA=0, shrinkB=half)
                 if math.hypot(gap_x, gap_y) > near else None)
        annotations.append(ax.annotate(
            text, (x, y), xytext=((box[0] - ax_) * to_points, (box[1] - ay_) * to_points),
            textcoords="offset points", ha="left", va="bottom", fontsize=7, color=color, arrowprops=arrow,
            annotation_clip=False))
    return annotations
