"""The memory timeline as a PNG (matplotlib, Agg): for terminals, papers and issues.

    write_png("timeline.png", from_plan(plan))

A plan gives two panels: live memory stacked by category with the peak marked, and the
placement map (address against step); a replay with its trace adds the placement map of the
recorded blocks. The map is rasterised with numpy, one pixel grid filled
block by block, so a plan with 100,000 buffers draws as fast as one with ten. A replay gives
in use (solid) and reserved (dashed) per allocator, the capacity and the out-of-memory points.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxmem.reports.data import ReportData
from jaxmem.reports.html import COLORS, _EXTRA, downsample
from jaxmem.units import format_size

_MAP_W, _MAP_H = 1200, 500
_SMALL = 6  # blocks at most this many pixels wide and high are painted together


def _color(name: str, i: int) -> str:
    return COLORS.get(name, _EXTRA[i % len(_EXTRA)])


def _bytes_axis(ax) -> None:
    from matplotlib.ticker import FuncFormatter

    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(v)))


def _placement_image(data: ReportData) -> tuple[np.ndarray, int]:
    """An RGB image (address up, x to the right) of the blocks. Big blocks are painted one by
    one, largest first; the many that cover a few pixels at most are then painted on top all at
    once with numpy, so half a million trace blocks take about as long as a few thousand."""
    top = max([data.arena_bytes] + [b.address + b.size for b in data.blocks]) or 1
    span = data.x_max - data.x_min + 1
    img = np.ones((_MAP_H, _MAP_W, 3), dtype=np.float32)
    palette = np.ones((max(1, len(data.categories)), 3), dtype=np.float32)
    for i, c in enumerate(data.categories):
        h = _color(c, i).lstrip("#")
        palette[i] = [int(h[k:k + 2], 16) / 255 for k in (0, 2, 4)]
    index = {c: i for i, c in enumerate(data.categories)}
    n = len(data.blocks)
    cols = {name: np.fromiter((getattr(b, name) for b in data.blocks), np.int64, n)
            for name in ("start", "end", "address", "size")}
    cat = np.fromiter((index[b.category] for b in data.blocks), np.int64, n)
    x0 = (cols["start"] - data.x_min) * _MAP_W // span
    x1 = np.maximum(x0 + 1, (cols["end"] - data.x_min + 1) * _MAP_W // span)
    y0 = cols["address"] * _MAP_H // top
    y1 = np.maximum(y0 + 1, (cols["address"] + cols["size"]) * _MAP_H // top)
    w, h = np.minimum(x1, _MAP_W) - x0, np.minimum(y1, _MAP_H) - y0
    small = (w <= _SMALL) & (h <= _SMALL)
    order = np.argsort(-cols["size"], kind="stable")   # largest first: small ones stay visible
    for k in order[~small[order]]:
        img[_MAP_H - y1[k]:_MAP_H - y0[k], x0[k]:x1[k]] = palette[cat[k]]
    ks = order[small[order]]
    for dy in range(_SMALL):
        for dx in range(_SMALL):
            m = ks[(w[ks] > dx) & (h[ks] > dy)]
            if len(m):
                img[_MAP_H - 1 - (y0[m] + dy), x0[m] + dx] = palette[cat[m]]
    return img, top


def write_png(path: str | Path, data: ReportData, dpi: int = 110) -> None:
    """Draw the report's timeline (and for a plan, its placement map) into a PNG file."""
    with open(path, "wb") as out:  # first, so an unwritable path fails before the drawing
        _draw(out, data, dpi)


def _draw(out, data: ReportData, dpi: int) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    is_plan = data.kind == "plan"
    panels = (1 if data.categories else 0) + (1 if data.allocators else 0) + (1 if data.blocks else 0)
    # A fixed layout: matplotlib's constrained layout draws the figure twice, doubling the time.
    height = 3.4 * max(1, panels)
    fig = Figure(figsize=(12, height), dpi=dpi)
    fig.subplots_adjust(left=0.08, right=0.985, top=1 - 0.35 / height, bottom=0.5 / height, hspace=0.5)
    axes = fig.subplots(max(1, panels), 1, squeeze=False)[:, 0]
    k = 0
    if data.allocators:
        ax = axes[k]; k += 1
        for i, a in enumerate(data.allocators):
            color = f"C{i}"
            ax.step(a.xs, a.in_use, where="post", color=color, lw=1.2, label=f"{a.name} in use")
            ax.step(a.xs, a.reserved, where="post", color=color, lw=1.2, ls="--", label=f"{a.name} reserved")
            if a.oom_x is not None:
                ax.plot([a.oom_x], [a.peak_reserved], marker="v", color=color, ms=9)
                ax.annotate(f"OOM ({a.name})", (a.oom_x, a.peak_reserved), textcoords="offset points", xytext=(6, 4), color=color)
        if data.capacity:
            ax.axhline(data.capacity, color="black", ls=":", lw=1, label="capacity")
        ax.set_title(f"{data.title}: in use and reserved per allocator")
        ax.set_xlabel(data.x_label)
        ax.set_xlim(data.x_min, data.x_max + 1)
        top = max([data.capacity or 0] + [max(a.reserved + a.in_use, default=0) for a in data.allocators])
        ax.set_ylim(0, max(1, top) * 1.45)  # room above the lines for the legend
        _bytes_axis(ax)
        ax.legend(fontsize=7, ncols=4, loc="upper left")
    if data.categories:
        ax = axes[k]; k += 1
        # At most ~2000 points (the busiest x of each bucket, so the peak stays): a wider
        # figure would not show more, and the drawing time grows with the points.
        pts = downsample(data, 2000)
        xs = np.asarray(pts["x"] + [data.x_max + 1])
        ys = [np.asarray(col + col[-1:], dtype=np.float64) for col in pts["cols"]]
        ax.stackplot(xs, ys, labels=[c.replace("_", " ") for c in data.categories], step="post",
                     colors=[_color(c, i) for i, c in enumerate(data.categories)])
        ax.axvline(data.peak_x, color="#c62828", ls="--", lw=1)
        right = data.peak_x - data.x_min > 0.7 * (data.x_max - data.x_min + 1)  # label left of a late peak
        ax.annotate(f"peak {format_size(data.peak_bytes)} at {data.x_label} {data.peak_x}",
                    (data.peak_x, data.peak_bytes), textcoords="offset points", xytext=(-4 if right else 4, 2),
                    ha="right" if right else "left", color="#c62828")
        ax.set_xlim(data.x_min, data.x_max + 1)
        ax.set_ylim(0, max(1, data.peak_bytes) * 1.18)  # headroom for the legend and the peak's label
        ax.set_title(f"{data.title}: live memory by category" if is_plan else f"{data.title}: live blocks (recorded)")
        ax.set_xlabel(data.x_label)
        _bytes_axis(ax)
        ax.legend(fontsize=8, loc="upper left" if right else "upper right", ncols=3)
    if data.blocks:
        ax = axes[k]
        img, top = _placement_image(data)
        ax.imshow(img, aspect="auto", extent=(data.x_min, data.x_max + 1, 0, top), interpolation="nearest")
        ax.axvline(data.peak_x, color="#c62828", ls="--", lw=1)
        if data.arena_bytes < top:
            ax.axhline(data.arena_bytes, color="black", ls="--", lw=0.8)
        ax.set_title("placement map: address against step" if is_plan else "placement map: recorded address (unused gaps removed) against event")
        ax.set_xlabel(data.x_label)
        _bytes_axis(ax)
    # Always PNG, at exactly `path`: given a name, matplotlib would pick the format from its
    # extension (and fail on an unknown one) or add ".png" to a name without one.
    out.seek(0)
    fig.savefig(out, format="png")
