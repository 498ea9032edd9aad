"""The plain data every report is drawn from: blocks in address and time, stacked live bytes.

Every writer (HTML, pprof, PNG, Chrome trace, terminal) reads a `ReportData`; none reads a
Plan or a replay directly. `from_plan` and `from_replay` build it.

    data = from_plan(plan)
    data.peak_bytes, data.live_at(data.peak_x)[:3]

Time is an integer x: for a plan, the step index, from -1 (on entry) to len(schedule) (on
exit); for a trace, the event index. A `Block` occupies [start, end], both inclusive.
"""

from __future__ import annotations

import bisect
import gc
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

from jaxmem.compiler.plan_types import Plan, SourceLine
from jaxmem.errors import PlanError
from jaxmem.reports.categories import CATEGORIES, buffer_category, value_categories

Frame = tuple[str, int, str]   # (file, line, function), innermost first in a stack


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many small objects: with a million
    trace events alive, each automatic collection walks them all, and building the blocks of
    a big trace spent most of its time there."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(slots=True)
class Block:
    """One rectangle of the placement map: `size` bytes at `address` during [start, end]."""

    address: int
    size: int
    start: int
    end: int
    category: str
    label: str = ""                # the producing primitive, or "scan scratch", "argument 3"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    frames: tuple[Frame, ...] = ()  # the user's stack, innermost first
    buffer: int = -1               # plan buffer id / trace block number
    region: str = "arena"          # "arena" | "caller" (non-donated arguments)

    @property
    def source(self) -> str:
        """The innermost frame with a real line (recorded stacks often start in C++ frames
        such as '??:0'), else the innermost."""
        if not self.frames:
            return ""
        file, line, function = next((f for f in self.frames if f[1] > 0 and f[0] not in ("", "??")), self.frames[0])
        return f"{file}:{line} ({function})"


@dataclass
class AllocatorSeries:
    """One replayed allocator: in use and reserved bytes after each event."""

    name: str
    xs: list[int]
    times_us: list[float]
    in_use: list[int]
    reserved: list[int]
    peak_in_use: int
    peak_reserved: int
    oom_x: int | None = None       # event index of the first out-of-memory
    oom_text: str = ""


@dataclass
class ReportData:
    """Everything a report shows, as plain data: the x range, bytes per category at each x,
    the blocks (placement map, tables, pprof), replayed allocators' lines and a summary.

    >>> from jaxmem.reports.doc_example import sgd_step_plan
    >>> plan = sgd_step_plan()   # one SGD step: w (64, 64) is updated and returned, x (8, 64) only read
    >>> from jaxmem.reports.data import from_plan
    >>> data = from_plan(plan)
    >>> data.categories, data.peak_x, data.peak_bytes
    (['parameters', 'inputs', 'residuals', 'gradients', 'temporaries', 'outputs'], 7, 36864)
    """

    kind: str                      # "plan" | "replay"
    title: str
    x_label: str                   # "step" | "event"
    x_min: int
    x_max: int
    x_names: list[str]             # what happens at each x (index x - x_min)
    categories: list[str]          # in stacking order, only those present
    stacked: dict[str, list[int]]  # bytes per category at each x (index x - x_min)
    blocks: list[Block]
    arena_bytes: int               # top of the placement map's address range
    peak_x: int
    peak_bytes: int
    summary: list[tuple[str, str]] = field(default_factory=list)
    allocators: list[AllocatorSeries] = field(default_factory=list)
    capacity: int | None = None
    # More tables, drawn as they are: (heading, column names, rows of cell text).
    tables: list[tuple[str, list[str], list[list[str]]]] = field(default_factory=list)

    @property
    def totals(self) -> list[int]:
        """Live bytes at each x (index x - x_min), all categories together."""
        cols = [self.stacked[c] for c in self.categories]
        return [sum(vals) for vals in zip(*cols)] if cols else [0] * (self.x_max - self.x_min + 1)

    def live_at(self, x: int) -> list[Block]:
        """Blocks live at x, largest first."""
        if not self.x_min <= x <= self.x_max:
            raise PlanError(f"{self.x_label} {x} is outside {self.x_min}..{self.x_max}")
        live = [b for b in self.blocks if b.start <= x <= b.end]
        live.sort(key=lambda b: (-b.size, b.address))
        return live


def _frames(source: SourceLine | None) -> tuple[Frame, ...]:
    if source is None:
        return ()
    return ((source.file, source.line, source.function),)


def _stack(data: ReportData, blocks: Iterable[Block]) -> None:
    """Fill data.stacked from the blocks with a difference array per category: O(blocks + x)."""
    width = data.x_max - data.x_min + 1
    diff = {c: [0] * (width + 1) for c in data.categories}
    for b in blocks:
        d = diff[b.category]
        d[b.start - data.x_min] += b.size
        d[b.end - data.x_min + 1] -= b.size
    for c in data.categories:
        run, col, d = 0, [0] * width, diff[c]
        for i in range(width):
            run += d[i]
            col[i] = run
        data.stacked[c] = col


def _peak(data: ReportData) -> None:
    totals = data.totals
    best = max(range(len(totals)), key=totals.__getitem__) if totals else 0
    data.peak_x = data.x_min + best
    data.peak_bytes = totals[best] if totals else 0


def _order(categories: Iterable[str]) -> list[str]:
    present = set(categories)
    known = [c for c in CATEGORIES if c in present]
    return known + sorted(present - set(CATEGORIES))


def _last_uses(plan: Plan) -> dict[int, int]:
    last: dict[int, int] = {}
    for step in plan.schedule:
        for v in step.inputs:
            last[v] = step.index
    end = len(plan.schedule)
    for v in plan.outvars:
        if v is not None:
            last[v] = end
    return last


def _call_site_frames(plan: Plan) -> dict[int, tuple[Frame, ...]]:
    """For equations inside a call (a jitted library function such as `jax.nn.log_softmax`)
    whose own traceback ends inside JAX, the user's frames of the call that ran them, keyed by
    id(eqn): the planner inlines calls, and these equations would otherwise have no source."""
    from jaxmem.compiler.jaxpr_adapter import call_body, jaxpr_eqns, split_closed, user_frames

    found: dict[int, tuple[Frame, ...]] = {}
    if plan.closed_jaxpr is None:
        return found
    pending = [(split_closed(plan.closed_jaxpr)[0], ())]
    while pending:
        jaxpr, outer = pending.pop()
        for eqn in jaxpr_eqns(jaxpr):
            frames = user_frames(eqn) or outer
            if frames and frames is outer:
                found[id(eqn)] = frames
            body = call_body(eqn)
            if body is not None:
                pending.append((body[0], frames))
    return found


def plan_blocks(plan: Plan, cats: dict[int, str] | None = None, arg_paths: list[str] | None = None) -> list[Block]:
    """The plan's memory as blocks: each arena buffer split where a new value takes it over,
    plus one block per non-donated argument in a "caller" region above the arena.

    A buffer passes from one value to the next (an output written over a donated argument, an
    in-place update) when the next value is defined and the previous one is no longer read;
    a view that shares storage while its operand is still read does not take it over.
    """
    from jaxmem.compiler.jaxpr_adapter import user_frames

    inherited = _call_site_frames(plan)
    cats = value_categories(plan) if cats is None else cats
    # Arguments are named by their pytree path when the caller gives it ("params['w']").
    paths = arg_paths
    arg_label = {v: (str(paths[i]) if paths and i < len(paths) and paths[i] else f"argument {i}")
                 for i, v in enumerate(plan.invars)}
    last = _last_uses(plan)
    steps = plan.schedule
    step_frames: dict[int, tuple[Frame, ...]] = {}

    def frames_of(v: int | None, step: Any, source: SourceLine | None) -> tuple[Frame, ...]:
        # The whole user stack from the equation (what pprof wants), else the one source line.
        if step is not None:
            found = step_frames.get(step.index)
            if found is None:
                own = user_frames(step.eqn) if step.eqn is not None else ()
                found = step_frames[step.index] = own or inherited.get(id(step.eqn), ())
            if found:
                return found
        return _frames(source)
    blocks: list[Block] = []
    for buf in plan.buffers:
        values = [v for v in buf.values if v in plan.values]
        first_cat = cats.get(values[0]) if values else None
        if not values:
            owner = steps[buf.start] if 0 <= buf.start < len(steps) else None
            frames = frames_of(None, owner, buf.source or (owner.source if owner is not None else None))
            blocks.append(Block(buf.offset, buf.size, buf.start, buf.end, buffer_category(buf.kind, first_cat),
                                buf.label or buf.kind, buf.shape, buf.dtype, frames, buf.id))
            continue
        # Who owns the storage when: a sweep in definition order.
        owners: list[tuple[int, int]] = []   # (from x, value)
        for v in values:
            info = plan.values[v]
            defined = buf.start if info.producer is None else max(info.producer, buf.start)
            if not owners:
                owners.append((buf.start, v))
                continue
            current = owners[-1][1]
            switch = max(defined, min(last.get(current, defined - 1) + 1, buf.end + 1), owners[-1][0] + 1)
            if switch > buf.end:
                continue
            owners.append((switch, v))
        for i, (frm, v) in enumerate(owners):
            to = owners[i + 1][0] - 1 if i + 1 < len(owners) else buf.end
            info = plan.values[v]
            producer = steps[info.producer] if info.producer is not None and info.producer < len(steps) else None
            label = producer.primitive if producer is not None else arg_label.get(v, buf.label or buf.kind)
            source = info.source or (producer.source if producer is not None else None) or buf.source
            frames = frames_of(v, producer, source)
            category = buffer_category(buf.kind, cats.get(v, first_cat))
            blocks.append(Block(buf.offset, buf.size, frm, to, category, label,
                                tuple(info.shape), info.dtype, frames, buf.id))
    # Non-donated arguments stay in the caller's memory: stack them above the arena.
    top = plan.arena_bytes
    end = len(steps)
    for v in plan.invars:
        info = plan.values.get(v)
        if info is None or info.buffer is not None:
            continue
        blocks.append(Block(top, info.nbytes, -1, end, cats.get(v, "parameters"), arg_label[v],
                            tuple(info.shape), info.dtype, _frames(info.source), -1, "caller"))
        top += info.nbytes
    return blocks


def from_plan(plan: Plan, title: str = "", arg_paths: list[str] | None = None) -> ReportData:
    """Report data for a memory plan.

    >>> import jax.numpy as jnp, jaxmem
    >>> data = from_plan(jaxmem.plan(lambda x, w: jnp.tanh(x @ w).sum(), jnp.ones((8, 64)), jnp.ones((64, 64))))
    >>> data.peak_bytes == sum(b.size for b in data.live_at(data.peak_x))
    True

    Args:
        plan: the planner's `Plan`.
        title: shown at the top of the report (e.g. the TARGET).
        arg_paths: optional pytree path of each flat argument, to name optimizer state.

    Returns:
        a `ReportData` with x from -1 (entry) to len(plan.schedule) (exit).
    """
    from jaxmem.units import format_size

    with paused_gc():
        cats = value_categories(plan, arg_paths)
        blocks = plan_blocks(plan, cats, arg_paths)
    n = len(plan.schedule)
    names = ["entry"] + [s.primitive for s in plan.schedule] + ["exit"]
    data = ReportData(
        kind="plan", title=title or "memory plan", x_label="step", x_min=-1, x_max=n, x_names=names,
        categories=_order(b.category for b in blocks), stacked={}, blocks=blocks,
        arena_bytes=plan.arena_bytes, peak_x=-1, peak_bytes=0,
    )
    with paused_gc():
        _stack(data, blocks)
    _peak(data)
    caller = sum(b.size for b in blocks if b.region == "caller")
    rows = [
        ("planned peak", format_size(plan.peak_bytes)),
        ("arena", format_size(plan.arena_bytes)),
        ("arguments kept by the caller", format_size(caller)),
        ("live at the peak step", f"{format_size(data.peak_bytes)} at step {data.peak_x}"),
        ("by category there", ", ".join(f"{c.replace('_', ' ')} {format_size(data.stacked[c][data.peak_x - data.x_min])}"
                                         for c in data.categories if data.stacked[c][data.peak_x - data.x_min])),
        ("lower bound", format_size(plan.lower_bound_bytes)),
    ]
    if plan.xla is not None:
        rows.append(("XLA total here", format_size(plan.xla.total_bytes)))
    rows += [
        ("steps / buffers", f"{n} / {len(plan.buffers)}"),
        ("schedule / placement", f"{plan.scheduler or '-'} / {plan.placement or '-'}"),
        ("checker", "valid" if plan.valid else "NOT VALIDATED"),
    ]
    data.summary = rows
    return data


def python_frames(frames: Iterable[Any]) -> tuple[Frame, ...]:
    """A recorded stack as (file, line, function), innermost first, keeping only the Python
    frames when there are any: PyTorch's snapshots interleave C++ frames ('??:0',
    'torch::unwind::unwind()') that would otherwise own every byte in pprof's flat view."""
    every = tuple((f.filename, f.line, f.name) for f in frames)
    python = tuple(f for f in every if f[0].endswith(".py") and f[1] > 0)
    return python or every


def trace_blocks(trace: Any) -> list[Block]:
    """The blocks of a recorded trace at their recorded addresses: each alloc until its free
    (blocks live at the start of the window from x=0; blocks never freed to the last event)."""
    events = trace.events
    last = max(0, len(events) - 1)
    blocks: list[Block] = []
    open_: dict[int, Block] = {}
    for b in getattr(trace, "initial_blocks", ()):
        if getattr(b, "allocated", True):
            blk = Block(b.addr, b.size, 0, last, "allocations", "before the window", buffer=-1)
            open_[b.addr] = blk
            blocks.append(blk)
    for i, e in enumerate(events):
        if e.action == "alloc":
            frames = python_frames(e.frames)
            category = e.label if e.label in CATEGORIES else "allocations"
            blk = Block(e.addr, e.size, i, last, category, e.label, frames=frames, buffer=i)
            open_[e.addr] = blk
            blocks.append(blk)
        elif e.action == "free":
            blk = open_.pop(e.addr, None)
            if blk is not None:
                blk.end = max(blk.start, i - 1)
    return blocks


def compact_addresses(blocks: list[Block], min_gap: int = 16 << 20) -> int:
    """Move blocks down so that the address ranges no block ever uses, when at least `min_gap`
    bytes long, vanish: device addresses sit near 2**47 in segments far apart, and a map of
    that range would be one thin line. Order and adjacency are kept; smaller holes stay
    visible. Returns the number of gaps removed (the space below the lowest block is not one).
    """
    if not blocks:
        return 0
    clusters: list[list[int]] = []
    for lo, hi in sorted((b.address, b.address + b.size) for b in blocks):
        if clusters and lo - clusters[-1][1] < min_gap:
            clusters[-1][1] = max(clusters[-1][1], hi)
        else:
            clusters.append([lo, hi])
    starts, shifts, compact = [], [], 0
    for lo, hi in clusters:
        starts.append(lo)
        shifts.append(lo - compact)
        compact += hi - lo
    for b in blocks:
        b.address -= shifts[bisect.bisect_right(starts, b.address) - 1]
    return len(clusters) - 1


def from_replay(report: Any, trace: Any = None, title: str = "") -> ReportData:
    """Report data for a replay: in use and reserved per allocator (and the recorded allocator's
    own, for snapshots), and, given the trace, its blocks at their recorded addresses.

    >>> from jaxmem.traces.model import Event, Trace
    >>> from jaxmem.traces.replay import replay
    >>> trace = Trace([Event("alloc", 1, 1024, requested=1000), Event("free", 1, 1024)])
    >>> data = from_replay(replay(trace, ["caching", "bfc"], capacity=80 << 30, progress=False), trace)
    >>> data.kind, data.x_min, data.x_max, data.peak_x, data.peak_bytes
    ('replay', 0, 1, 0, 1024)

    Args:
        report: a `jaxmem.traces.replay.ReplayReport`.
        trace: the replayed `Trace`, for the placement map, the stacked live bytes and the
            largest blocks at the peak (optional).
        title: shown at the top (default: the trace's file).

    Returns:
        a `ReportData` with x the event index.
    """
    from jaxmem.units import format_size

    series: list[AllocatorSeries] = []
    runs = list(report.runs.items())
    if getattr(report, "recorded", None) is not None:
        runs.append(("recorded", report.recorded))
    for name, run in runs:
        tl = list(run.timeline)
        oom = getattr(run, "oom", None)
        series.append(AllocatorSeries(
            name=name, xs=[int(p[0]) for p in tl], times_us=[float(p[1]) for p in tl],
            in_use=[int(p[2]) for p in tl], reserved=[int(p[3]) for p in tl],
            peak_in_use=max((int(p[2]) for p in tl), default=0),
            peak_reserved=int(getattr(run, "peak_reserved_bytes", 0)) or max((int(p[3]) for p in tl), default=0),
            oom_x=int(oom["event_index"]) if oom else None,
            oom_text=str(oom.get("message", "out of memory")) if oom else "",
        ))
    with paused_gc():
        blocks = trace_blocks(trace) if trace is not None else []
        gaps = compact_addresses(blocks)
    n_events = len(trace.events) if trace is not None else max((max(s.xs, default=0) for s in series), default=0) + 1
    names = [e.action for e in trace.events] if trace is not None else [""] * n_events
    data = ReportData(
        kind="replay", title=title or getattr(report, "source", "") or "replay", x_label="event",
        x_min=0, x_max=max(0, n_events - 1), x_names=names, categories=_order(b.category for b in blocks),
        stacked={}, blocks=blocks, arena_bytes=max((b.address + b.size for b in blocks), default=0),
        peak_x=0, peak_bytes=0, allocators=series, capacity=getattr(report, "capacity", None),
    )
    if blocks:
        with paused_gc():
            _stack(data, blocks)
        _peak(data)
    elif series:
        best = max(series, key=lambda s: s.peak_in_use)
        if best.xs:
            k = max(range(len(best.xs)), key=best.in_use.__getitem__)
            data.peak_x, data.peak_bytes = best.xs[k], best.in_use[k]
    rows = [("trace", f"{getattr(report, 'source', '')} ({getattr(report, 'format', '')}, {getattr(report, 'events', n_events)} replayed events)"),
            ("capacity", format_size(data.capacity) if data.capacity else "-")]
    for s in series:
        oom = f"; out of memory at event {s.oom_x}: {s.oom_text}" if s.oom_x is not None else ""
        rows.append((s.name, f"peak in use {format_size(s.peak_in_use)}, peak reserved {format_size(s.peak_reserved)}{oom}"))
    if blocks:
        rows.append(("recorded blocks live at the peak", f"{format_size(data.peak_bytes)} at event {data.peak_x}"))
    if gaps:
        rows.append(("placement map", f"recorded addresses with {gaps} unused gaps between them removed"))
    data.summary = rows
    return data
