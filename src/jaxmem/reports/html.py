"""One self-contained HTML report: charts drawn on canvas by an inline script, nothing fetched.

    write_html("report.html", from_plan(plan))

The page embeds the report as JSON in a `<script type="application/json">` element and draws
it with report.js (inline): the live memory stacked by category with the peak marked (or, for
a replay, in use and reserved per allocator with the out-of-memory point), the placement map
(address against time, one rectangle per block), and the largest blocks live at the peak;
hovering a block or a row shows its shape, dtype, size and source line.

Big programs stay quick to open: the timeline keeps at most `MAX_POINTS` points (for each
bucket the x with the most live bytes, so the peak survives), and the map draws the
`MAX_BLOCKS` blocks with the largest drawn area; the rest, too small to see one by one, are
merged per category into cells of a coarse address-by-time grid and drawn as one shaded
rectangle each, whose tooltip says how many blocks and bytes it stands for.

Names from user code (function names, file paths) are data: the JSON is escaped so that no
`</script>` can end its element, and the script puts text on the page with `textContent` only.
"""

from __future__ import annotations

import html
import json
from importlib import resources
from pathlib import Path
from typing import Any

from jaxmem.reports.data import AllocatorSeries, Block, ReportData, paused_gc

MAX_POINTS = 4000
MAX_BLOCKS = 20000
TOP_ROWS = 40
_GRID_X, _GRID_Y = 400, 200

COLORS = {
    "parameters": "#4c78a8",
    "optimizer_state": "#9d6fd0",
    "inputs": "#72b7b2",
    "residuals": "#f58518",
    "gradients": "#e45756",
    "temporaries": "#a0a7b4",
    "outputs": "#54a24b",
    "allocations": "#4c78a8",
}
_EXTRA = ["#eeca3b", "#ff9da6", "#9d755d", "#bab0ac", "#b279a2"]


def _asset(name: str) -> str:
    return resources.files("jaxmem.reports").joinpath(name).read_text(encoding="utf-8")


def _script_json(obj: Any) -> str:
    """JSON that is safe inside a <script> element: no '<', '>' or '&' and no line separators
    survive literally, so user strings such as '</script><script>...' stay inert data."""
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    for raw, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(raw, esc)
    return text


def downsample(data: ReportData, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """The stacked timeline with at most `max_points` points: per bucket of consecutive x, the
    x with the most live bytes (so the peak is always kept)."""
    totals = data.totals
    n = len(totals)
    if n == 0:
        return {"x": [], "names": [], "cols": [], "total": [], "span": []}
    size = max(1, -(-n // max_points))
    picks, spans = [], []
    for lo in range(0, n, size):
        hi = min(n, lo + size)
        best = max(range(lo, hi), key=totals.__getitem__)
        picks.append((lo, best))
        spans.append(hi - lo)
    return {
        "x": [data.x_min + lo for lo, _ in picks],
        "names": [data.x_names[b] if b < len(data.x_names) else "" for _, b in picks],
        "cols": [[data.stacked[c][b] for _, b in picks] for c in data.categories],
        "total": [totals[b] for _, b in picks],
        "span": spans,
    }


def _shape(block: Block) -> str:
    return ",".join(str(d) for d in block.shape)


def split_visible(data: ReportData, max_blocks: int = MAX_BLOCKS) -> tuple[list[Block], list[Block]]:
    """(blocks drawn one by one, blocks merged into aggregates): the `max_blocks` with the
    largest drawn area (bytes x duration) are drawn; blocks live at the peak always are."""
    blocks = data.blocks
    if len(blocks) <= max_blocks:
        return list(blocks), []
    order = sorted(range(len(blocks)), key=lambda i: -blocks[i].size * (blocks[i].end - blocks[i].start + 1))
    keep = set(order[:max_blocks])
    at_peak = sorted((i for i, b in enumerate(blocks) if b.start <= data.peak_x <= b.end), key=lambda i: -blocks[i].size)
    keep.update(at_peak[:TOP_ROWS])
    shown = [blocks[i] for i in sorted(keep)]
    rest = [blocks[i] for i in range(len(blocks)) if i not in keep]
    return shown, rest


def aggregate(data: ReportData, rest: list[Block], top: int) -> dict[str, list]:
    """Merge small blocks per (category, time cell, address cell) into one rectangle each: the
    cell's members' bounding box, with the fraction of it they fill, their count and bytes."""
    keys = ("addr", "size", "start", "end", "cat", "count", "bytes", "fill")
    if not rest:
        return {k: [] for k in keys}
    import numpy as np

    span = max(1, data.x_max - data.x_min + 1)
    cat_index = {c: i for i, c in enumerate(data.categories)}
    cat = np.fromiter((cat_index[b.category] for b in rest), np.int64, len(rest))
    lo = np.fromiter((b.address for b in rest), np.int64, len(rest))
    size = np.fromiter((b.size for b in rest), np.int64, len(rest))
    start = np.fromiter((b.start for b in rest), np.int64, len(rest))
    end = np.fromiter((b.end for b in rest), np.int64, len(rest))
    cell = (cat * _GRID_X + (start - data.x_min) * _GRID_X // span) * (_GRID_Y + 1) + lo * _GRID_Y // max(1, top)
    cells, which = np.unique(cell, return_inverse=True)
    k = len(cells)

    def reduce(op, values, init):
        out = np.full(k, init, dtype=np.int64)
        op.at(out, which, values)
        return out

    c_lo, c_hi = reduce(np.minimum, lo, np.iinfo(np.int64).max), reduce(np.maximum, lo + size, 0)
    c_start, c_end = reduce(np.minimum, start, np.iinfo(np.int64).max), reduce(np.maximum, end, np.iinfo(np.int64).min)
    count = np.bincount(which, minlength=k)
    nbytes = reduce(np.add, size, 0)
    area = np.bincount(which, weights=(size * (end - start + 1)).astype(np.float64), minlength=k)
    c_cat = reduce(np.maximum, cat, 0)
    fill = np.minimum(1.0, area / np.maximum(1, (c_hi - c_lo) * (c_end - c_start + 1)))  # members may overlap
    return {"addr": c_lo.tolist(), "size": (c_hi - c_lo).tolist(), "start": c_start.tolist(), "end": c_end.tolist(),
            "cat": c_cat.tolist(), "count": count.tolist(), "bytes": nbytes.tolist(),
            "fill": np.round(fill, 4).tolist()}


def _series(a: AllocatorSeries, max_points: int = MAX_POINTS) -> dict[str, Any]:
    """An allocator's lines, at most `max_points` per series: per bucket the largest values."""
    n = len(a.xs)
    size = max(1, -(-n // max_points))
    xs, inuse, reserved = [], [], []
    for lo in range(0, n, size):
        hi = min(n, lo + size)
        xs.append(a.xs[lo]); inuse.append(max(a.in_use[lo:hi])); reserved.append(max(a.reserved[lo:hi]))
    return {"name": a.name, "x": xs, "inUse": inuse, "reserved": reserved, "peakInUse": a.peak_in_use,
            "peakReserved": a.peak_reserved, "oomX": a.oom_x, "oomText": a.oom_text}


def payload(data: ReportData) -> dict[str, Any]:
    """The JSON the page draws from (also what the tests read back)."""
    with paused_gc():
        return _payload(data)


def _payload(data: ReportData) -> dict[str, Any]:
    colors = dict(COLORS)
    for i, c in enumerate(c for c in data.categories if c not in colors):
        colors[c] = _EXTRA[i % len(_EXTRA)]
    cat_index = {c: i for i, c in enumerate(data.categories)}
    caller = [b for b in data.blocks if b.region == "caller"]
    top = max([data.arena_bytes] + [b.address + b.size for b in data.blocks])
    shown, rest = split_visible(data)
    infos: dict[tuple, int] = {}
    cols: dict[str, list] = {k: [] for k in ("addr", "size", "start", "end", "cat", "info")}
    position: dict[int, int] = {}
    for b in shown:
        key = (b.label, _shape(b), b.dtype, b.source, b.region)
        cols["addr"].append(b.address); cols["size"].append(b.size)
        cols["start"].append(b.start); cols["end"].append(b.end)
        cols["cat"].append(cat_index[b.category]); cols["info"].append(infos.setdefault(key, len(infos)))
        position[id(b)] = len(cols["addr"]) - 1
    live = data.live_at(data.peak_x)[:TOP_ROWS]
    rows = [{"size": b.size, "category": b.category, "shape": _shape(b), "dtype": b.dtype, "label": b.label,
             "source": b.source, "start": b.start, "end": b.end, "address": b.address,
             "block": position.get(id(b), -1)} for b in live]
    return {
        "kind": data.kind, "title": data.title, "xLabel": data.x_label, "xMin": data.x_min, "xMax": data.x_max,
        "categories": data.categories, "colors": {c: colors[c] for c in data.categories},
        "points": downsample(data) if data.categories else None,
        "peak": {"x": data.peak_x, "bytes": data.peak_bytes},
        "addressTop": top, "callerBase": caller[0].address if caller else None,
        "blocks": cols, "info": [list(k) for k in infos], "aggregates": aggregate(data, rest, top),
        "top": rows, "summary": [list(r) for r in data.summary],
        "allocators": [_series(a) for a in data.allocators], "capacity": data.capacity,
    }


def render_table(heading: str, columns: list[str], rows: list[list[str]]) -> str:
    """A static table (every cell escaped: names from user code are data).

    >>> render_table("T", ["a"], [["<b>"]])
    '<h2>T</h2><table class="static"><thead><tr><th>a</th></tr></thead><tbody><tr><td>&lt;b&gt;</td></tr></tbody></table>'
    """
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<h2>{html.escape(heading)}</h2><table class=\"static\"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(data: ReportData) -> str:
    """The report page as one string: styles, data and script inline.

    >>> import jax, jax.numpy as jnp, jaxmem
    >>> def step(w, x):   # one SGD step: w is updated and returned, x only read
    ...     return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> plan = jaxmem.plan(step, jnp.ones((64, 64)), jnp.ones((8, 64)))
    >>> from jaxmem.reports.data import from_plan
    >>> page = render_html(from_plan(plan))
    >>> "http" in page.split("<body")[1]
    False
    """
    title = html.escape(data.title)
    is_plan = data.kind == "plan"
    top_heading = ("Largest buffers live at the peak (step %d)" if is_plan else "Largest blocks live at the peak (event %d)") % data.peak_x
    parts = [
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">",
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">",
        f"<title>jaxmem: {title}</title>",
        "<style>", _asset("report.css"), "</style></head><body>",
        f"<h1>jaxmem memory report</h1><div class=\"sub\">{title}</div>",
        "<table><tbody id=\"summary\"></tbody></table>",
    ]
    parts += [render_table(*table) for table in data.tables]
    if data.allocators:
        parts.append("<h2>In use and reserved over the trace, per allocator</h2><div class=\"legend\" id=\"alloc-legend\"></div>"
                     "<div class=\"chart\" id=\"lines\"></div>")
    if data.categories:
        heading = "Live memory over the schedule, by category" if is_plan else "Live memory over the recorded trace"
        parts.append(f"<h2>{heading}</h2><div class=\"legend\" id=\"legend\"></div><div class=\"chart\" id=\"stacked\"></div>")
    else:
        parts.append("<div class=\"legend\" id=\"legend\"></div>")
    map_heading = "Placement map: address against step" if is_plan else "Placement map: recorded address against event"
    if data.blocks:
        parts += [
            f"<h2>{map_heading}</h2><div class=\"chart\" id=\"map\"></div>",
            "<div class=\"hint\">Hover for details. Drag across a chart to zoom in time; double-click to zoom out.</div>",
            f"<h2>{html.escape(top_heading)}</h2>",
            "<table id=\"top\"><thead><tr><th class=\"num\">#</th><th class=\"num\">size</th><th>category</th>"
            "<th>dtype[shape]</th><th>op</th><th class=\"num\">live</th><th>source</th></tr></thead><tbody></tbody></table>",
        ]
    else:
        parts.append("<div class=\"hint\">Without the trace's blocks there is no placement map. "
                     "Drag across the chart to zoom in time; double-click to zoom out.</div>")
    parts += [
        "<div id=\"tip\"></div><div id=\"status\" data-errors=\"pending\">the report script did not run</div>",
        "<script type=\"application/json\" id=\"report-data\">", _script_json(payload(data)), "</script>",
        "<script>", _asset("report.js"), "</script></body></html>\n",
    ]
    return "".join(parts)


def write_html(path: str | Path, data: ReportData) -> int:
    """Write `render_html(data)` to `path`; returns the bytes written."""
    text = render_html(data)
    Path(path).write_text(text, encoding="utf-8")
    return len(text.encode("utf-8"))
