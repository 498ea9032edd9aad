"""Replay a trace's allocations and frees through allocators and measure what each would reserve.

Every allocator gets the same stream: the trace's "alloc" and "free" events, in order, from the
trace's start state. A free names the block by the address the recorder saw; the replay maps
that address to whatever the allocator handed out for the matching alloc (event identity),
so allocators that place blocks elsewhere are replayed faithfully.

    trace = load_trace("memory.pickle")
    report = replay(trace, ["caching", "bfc"], capacity=80 << 30)
    report.runs["caching"].device_allocs, report.recorded.device_allocs

The caching model starts from the recorded segments themselves (same sizes, same block layout,
same relative order); the other allocators start by allocating the blocks live at the start of
the window, largest address last.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Iterator

from jaxmem.errors import ConfigError, OutOfMemory, TraceError
from jaxmem.runtime.allocator import ReplayPair
from jaxmem.runtime.backends import SimulatedBackend
from jaxmem.traces.model import Trace

ALLOCATORS = ("caching", "caching-expandable", "bfc", "bfc-growth", "platform")
BFC_FRACTION = 0.75          # XLA_PYTHON_CLIENT_MEM_FRACTION's default
TIMELINE_POINTS = 4000       # timeline samples kept per run (extremes preserved)
_PROGRESS_STEP = 1 << 16

# What each entry of the stream does (`_ops`'s `kinds`); frees are the true values.
ALLOC, FREE, SEGMENT_FREE = 0, 1, 2


@dataclass
class ReplayRun:
    """What one allocator did with the stream."""

    allocator: str
    limit: int
    peak_in_use_bytes: int = 0
    peak_reserved_bytes: int = 0
    peak_event_index: int = -1              # trace event index of the in-use peak
    reserved_at_peak_bytes: int = 0         # reserved when in-use peaked
    largest_free_at_peak_bytes: int = 0
    reserved_over_in_use: float = 0.0       # at the in-use peak
    xla_fragmentation: float = 0.0          # (free - largest free block) / free at the in-use peak
    device_allocs: int = 0                  # device allocations made during the window
    device_alloc_bytes: int = 0
    device_frees: int = 0
    setup_device_allocs: int = 0            # made before the window (preallocation, start state)
    start_reserved_bytes: int = 0
    final_reserved_bytes: int = 0
    events_replayed: int = 0
    address_matches: int | None = None      # allocs placed at their recorded address (caching on snapshots)
    seconds: float = 0.0
    oom: dict[str, Any] | None = None
    timeline: list[tuple[int, float, int, int]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "peak_in_use_bytes": self.peak_in_use_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
            "device_allocs": self.device_allocs, "device_alloc_bytes": self.device_alloc_bytes,
            "device_frees": self.device_frees, "oom": self.oom, "limit": self.limit,
            "reserved_at_peak_bytes": self.reserved_at_peak_bytes,
            "reserved_over_in_use": self.reserved_over_in_use, "xla_fragmentation": self.xla_fragmentation,
            "peak_event_index": self.peak_event_index, "start_reserved_bytes": self.start_reserved_bytes,
            "final_reserved_bytes": self.final_reserved_bytes, "setup_device_allocs": self.setup_device_allocs,
            "events_replayed": self.events_replayed, "address_matches": self.address_matches,
        }


@dataclass
class RecordedRun:
    """What the recording allocator itself did in the window (snapshot traces)."""

    device_allocs: int
    device_alloc_bytes: int
    device_frees: int
    device_free_bytes: int
    start_reserved_bytes: int
    peak_reserved_bytes: int
    final_reserved_bytes: int
    timeline: list[tuple[int, float, int, int]] = field(default_factory=list)  # in_use is the rounded sum

    def to_json(self) -> dict[str, Any]:
        return {"device_allocs": self.device_allocs, "device_alloc_bytes": self.device_alloc_bytes,
                "device_frees": self.device_frees, "device_free_bytes": self.device_free_bytes,
                "start_reserved_bytes": self.start_reserved_bytes, "peak_reserved_bytes": self.peak_reserved_bytes,
                "final_reserved_bytes": self.final_reserved_bytes}


@dataclass
class ReplayReport:
    source: str
    format: str
    capacity: int
    events: int
    runs: dict[str, ReplayRun]
    recorded: RecordedRun | None = None
    settings: str = ""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"trace": self.source, "format": self.format, "capacity": self.capacity,
                               "events": self.events, "settings": self.settings,
                               "allocators": {n: r.to_json() for n, r in self.runs.items()}}
        if self.recorded is not None:
            out["recorded"] = self.recorded.to_json()
        return out


# ---- the stream ---------------------------------------------------------------------------------
def _ops(trace: Trace, segment_frees: bool = False) -> tuple[list[int], list[int], list[int], list[int], list[int], list[float]]:
    """Parallel lists for the hot loop: trace index, kind (ALLOC, FREE, SEGMENT_FREE), recorded
    addr, request, stream, time.

    With `segment_frees`, recorded segment_free events come along as SEGMENT_FREE (for the
    caching model on a snapshot, which follows the program's empty_cache calls)."""
    idx: list[int] = []
    kinds: list[int] = []
    addrs: list[int] = []
    sizes: list[int] = []
    streams: list[int] = []
    times: list[float] = []
    for i, e in enumerate(trace.events):
        a = e.action
        if a == "alloc":
            size = e.requested if e.requested is not None else e.size
            if type(size) is not int or size <= 0:
                raise TraceError(f"{trace.source}: event {i} (alloc): size must be a positive integer, got {size!r}")
            kinds.append(ALLOC)
            sizes.append(size)
        elif a == "free":
            kinds.append(FREE)
            sizes.append(0)
        elif a == "segment_free" and segment_frees:
            kinds.append(SEGMENT_FREE)
            sizes.append(e.size)
        else:
            continue
        idx.append(i)
        addrs.append(e.addr)
        streams.append(e.stream)
        times.append(e.time_us)
    return idx, kinds, addrs, sizes, streams, times


def _downsample(ev: list[int], t: list[float], inuse: list[int], res: list[int], points: int) -> list[tuple[int, float, int, int]]:
    n = len(ev)
    if n <= points:
        return list(zip(ev, t, inuse, res))
    import numpy as np

    a_in = np.asarray(inuse, dtype=np.int64)
    a_res = np.asarray(res, dtype=np.int64)
    buckets = max(points // 3, 1)
    edges = np.linspace(0, n, buckets + 1).astype(np.int64)
    keep = {0, n - 1}
    for lo, hi in zip(edges[:-1], edges[1:]):
        if hi <= lo:
            continue
        keep.add(int(lo + np.argmax(a_in[lo:hi])))
        keep.add(int(lo + np.argmin(a_in[lo:hi])))
        keep.add(int(lo + np.argmax(a_res[lo:hi])))
    return [(ev[k], t[k], inuse[k], res[k]) for k in sorted(keep)]


# ---- allocators -----------------------------------------------------------------------------------
class PagedDevice(SimulatedBackend):
    """A simulated GPU whose device allocations fail only when its bytes run out.

    cudaMalloc maps physical pages behind fresh virtual addresses, so free device memory
    scattered between live allocations still serves a large request. The plain
    SimulatedBackend carves one contiguous address range and would refuse it.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity * 64)
        self.capacity = capacity


def _make(name: str, trace: Trace, capacity: int, backend: Any, options: dict[str, Any] | None) -> tuple[Any, int]:
    from jaxmem.runtime.registry import make_allocator

    opts = dict(options or {})
    if name in ("caching", "caching-expandable"):
        if trace.allocator_settings and "settings" not in opts and "config" not in opts:
            opts["settings"] = trace.allocator_settings
        return make_allocator(name, backend, limit=capacity, **opts), capacity
    if name in ("bfc", "bfc-growth"):
        limit = int(capacity * BFC_FRACTION)
        return make_allocator(name, backend, limit=limit, preallocate=(name == "bfc"), **opts), limit
    return make_allocator(name, backend, limit=capacity, **opts), capacity


def _start_state(alloc: Any, pair: ReplayPair, trace: Trace, live: dict[int, Any], in_use: list[int]) -> None:
    """Install the trace's start state: fills `live` (rec addr -> entry) and `in_use[0]`."""
    if alloc.adopts_segments and trace.initial_segments and not alloc.config.expandable_segments \
            and not any(s.expandable for s in trace.initial_segments):
        for seg in sorted(trace.initial_segments, key=lambda s: s.addr):
            layout = [(b.addr - seg.addr, b.size, b.allocated) for b in seg.blocks]
            if not layout:
                layout = [(0, seg.size, False)]
            placed = alloc.adopt_segment(seg.size, seg.pool == "small", seg.stream, layout)
            for offset, block in placed.items():
                live[seg.addr + offset] = block
                in_use[0] += block.size
        return
    for b in sorted(trace.initial_blocks, key=lambda b: b.addr):
        if not b.allocated:
            continue
        size = b.size if b.size > 0 else (b.requested or 1)
        if pair.blocks:
            block = pair.allocate(size, b.stream)
            live[b.addr] = block
            in_use[0] += block.size
        else:
            entry = pair.allocate(size, 256, b.stream)
            live[b.addr] = entry
            in_use[0] += entry[1]
        alloc.settle_replay(in_use[0], 1, in_use[0])


def _size_of(entry: Any) -> int:
    return entry[1] if type(entry) is tuple else entry.size


def _oom_info(trace: Trace, event_index: int, request: int, err: OutOfMemory, live: dict[int, Any],
              in_use: int, reserved: int, ops: tuple, upto: int) -> dict[str, Any]:
    idx, kinds, addrs = ops[0], ops[1], ops[2]
    biggest = sorted(live.items(), key=lambda kv: -_size_of(kv[1]))[:10]
    wanted = {rec for rec, _ in biggest}
    alloc_event: dict[int, int] = {}
    for k in range(upto - 1, -1, -1):   # the latest alloc of each address before the failure
        if kinds[k] == ALLOC and addrs[k] in wanted and addrs[k] not in alloc_event:
            alloc_event[addrs[k]] = idx[k]
    rows = []
    for rec_addr, entry in biggest:
        row: dict[str, Any] = {"addr": rec_addr, "size": _size_of(entry)}
        ev_i = alloc_event.get(rec_addr)
        if ev_i is not None:
            e = trace.events[ev_i]
            row["event_index"] = ev_i
            frame = next((f for f in e.frames if f.line > 0), None)
            if frame is not None:
                row["frame"] = str(frame)
            if e.label:
                row["label"] = e.label
        rows.append(row)
    return {"event_index": event_index, "request": request, "in_use_bytes": in_use, "reserved_bytes": reserved,
            "live_blocks": len(live), "live_bytes": sum(_size_of(v) for v in live.values()),
            "largest_live": rows, "message": str(err).splitlines()[0] if str(err) else "out of memory"}


def replay_one(trace: Trace, name: str, *, capacity: int, options: dict[str, Any] | None = None,
               progress: Any = None, ops: tuple | None = None) -> ReplayRun:
    """Replay `trace` through the allocator `name` on a simulated device of `capacity` bytes."""
    if name == "caching" and trace.format == "torch-snapshot":
        from jaxmem.traces.recorded_device import RecordedDevice

        backend: Any = RecordedDevice(trace, capacity)   # the recorded cudaMalloc addresses
    else:
        backend = PagedDevice(capacity)
    alloc, limit = _make(name, trace, capacity, backend, options)
    run = ReplayRun(name, limit)
    ops = ops if ops is not None else _ops(trace)
    if getattr(backend, "kind", "") == "recorded" and any(e.action == "segment_free" for e in trace.events):
        # cudaFrees in the window come from the program (empty_cache) or from retries the model
        # makes itself at the same point; either way the model follows them
        ops = _ops(trace, segment_frees=True)
    idx, kinds, addrs, sizes, streams, times = ops
    live: dict[int, Any] = {}
    pair = alloc.replay_pair()
    start_in_use = [0]
    try:
        _start_state(alloc, pair, trace, live, start_in_use)
    except OutOfMemory as err:
        run.oom = _oom_info(trace, -1, 0, err, live, start_in_use[0], backend.reserved, ops, 0)
        return run
    in_use = start_in_use[0]
    run.setup_device_allocs = alloc.device_allocs
    base_allocs, base_bytes, base_frees = alloc.device_allocs, alloc.device_alloc_bytes, alloc.device_frees
    run.start_reserved_bytes = reserved = backend.reserved
    peak_in, peak_res, peak_at, res_at_peak = in_use, reserved, -1, reserved
    largest_at_peak = alloc.largest_free_block()
    tl_in: list[int] = []
    tl_res: list[int] = []
    state = [0, in_use, peak_in, peak_res, peak_at, False, largest_at_peak, res_at_peak]
    state_matches = [0]
    t0 = time.perf_counter()
    try:
        if pair.blocks:
            _loop_blocks(alloc, pair, backend, trace, ops, live, state, tl_in, tl_res, progress, state_matches)
        else:
            _loop_generic(alloc, pair, backend, trace, ops, live, state, tl_in, tl_res, progress)
    except OutOfMemory as err:
        j = state[0]
        run.oom = _oom_info(trace, idx[j], sizes[j], err, live, state[1], backend.reserved, ops, j)
    j, in_use, peak_in, peak_res, peak_at, dirty, largest_at_peak, res_at_peak = state
    run.seconds = time.perf_counter() - t0
    if dirty:
        largest_at_peak = alloc.largest_free_block()
        res_at_peak = backend.reserved
    run.events_replayed = j
    run.peak_in_use_bytes, run.peak_reserved_bytes = peak_in, peak_res
    run.peak_event_index = idx[peak_at] if peak_at >= 0 else -1
    run.reserved_at_peak_bytes, run.largest_free_at_peak_bytes = res_at_peak, largest_at_peak
    run.reserved_over_in_use = res_at_peak / peak_in if peak_in else 0.0
    free_at_peak = res_at_peak - peak_in
    run.xla_fragmentation = (free_at_peak - largest_at_peak) / free_at_peak if free_at_peak > 0 else 0.0
    run.device_allocs = alloc.device_allocs - base_allocs
    run.device_alloc_bytes = alloc.device_alloc_bytes - base_bytes
    run.device_frees = alloc.device_frees - base_frees
    run.final_reserved_bytes = backend.reserved
    if getattr(backend, "kind", "") == "recorded":
        run.address_matches = state_matches[0]
    run.timeline = _downsample(idx[:len(tl_in)], times[:len(tl_in)], tl_in, tl_res, TIMELINE_POINTS)
    return run


# The two replay loops, one per shape of the allocator's ReplayPair (blocks, or the hooks'
# tuples); the public allocate/free would build a Buffer per call. State lives in locals for
# speed and is written back to `state` (j, in_use, peak_in, peak_res, peak_at, dirty,
# largest_at_peak, res_at_peak) and to the allocator (`settle_replay`) when the loop ends or raises.
def _loop_blocks(alloc, pair, backend, trace, ops, live, state, tl_in, tl_res, progress, matches) -> None:
    idx, kinds, addrs, sizes, streams, _ = ops
    malloc, free = pair.allocate, pair.free
    largest_free_block, release_segment_at = alloc.largest_free_block, alloc.release_segment_at
    segment_free = SEGMENT_FREE     # a local: read on every free
    setdefault = live.setdefault
    same = 0
    j, in_use, peak_in, peak_res, peak_at, dirty, largest, res_at_peak = state
    add_in, add_res = tl_in.append, tl_res.append
    pop = live.pop
    try:
        for j in range(len(idx)):
            rec = addrs[j]
            kind = kinds[j]
            if kind:        # FREE or SEGMENT_FREE
                if dirty:   # the state right before the first free after a new peak is the peak
                    largest, res_at_peak, dirty = largest_free_block(), backend.reserved, False
                if kind == segment_free:
                    release_segment_at(rec)
                    add_in(in_use)
                    add_res(backend.reserved)
                    continue
                block = pop(rec, None)
                if block is None:
                    raise TraceError(f"{trace.source}: event {idx[j]} (free): free of unknown address {rec:#x}")
                in_use -= block.size   # before free: merging grows the block object
                free(block)
            else:
                block = malloc(sizes[j], streams[j])
                if setdefault(rec, block) is not block:
                    free(block)
                    raise TraceError(f"{trace.source}: event {idx[j]} (alloc): address {rec:#x} allocated twice without a free")
                in_use += block.size
                if block.addr == rec:
                    same += 1
                if in_use > peak_in:
                    peak_in, peak_at, dirty = in_use, j, True
            reserved = backend.reserved
            if reserved > peak_res:
                peak_res = reserved
            add_in(in_use)
            add_res(reserved)
            if progress is not None and not j & 0xFFFF:
                progress(j)
        j = len(idx)
    finally:
        alloc.settle_replay(in_use, kinds.count(ALLOC) if j == len(idx) else kinds[:j].count(ALLOC), peak_in)
        state[:] = [j, in_use, peak_in, peak_res, peak_at, dirty, largest, res_at_peak]
        matches[0] = same


def _loop_generic(alloc, pair, backend, trace, ops, live, state, tl_in, tl_res, progress) -> None:
    idx, kinds, addrs, sizes, streams, _ = ops
    allocate, free = pair.allocate, pair.free
    largest_free_block = alloc.largest_free_block
    j, in_use, peak_in, peak_res, peak_at, dirty, largest, res_at_peak = state
    add_in, add_res = tl_in.append, tl_res.append
    pop = live.pop
    try:
        for j in range(len(idx)):
            rec = addrs[j]
            if kinds[j]:    # FREE
                if dirty:
                    largest, res_at_peak, dirty = largest_free_block(), backend.reserved, False
                entry = pop(rec, None)
                if entry is None:
                    raise TraceError(f"{trace.source}: event {idx[j]} (free): free of unknown address {rec:#x}")
                free(entry[0], entry[1], entry[2], streams[j])
                in_use -= entry[1]
            else:
                if rec in live:
                    raise TraceError(f"{trace.source}: event {idx[j]} (alloc): address {rec:#x} allocated twice without a free")
                entry = allocate(sizes[j], 256, streams[j])
                live[rec] = entry
                in_use += entry[1]
                if in_use > peak_in:
                    peak_in, peak_at, dirty = in_use, j, True
            reserved = backend.reserved
            if reserved > peak_res:
                peak_res = reserved
            add_in(in_use)
            add_res(reserved)
            if progress is not None and not j & 0xFFFF:
                progress(j)
        j = len(idx)
    finally:
        alloc.settle_replay(in_use, kinds.count(ALLOC) if j == len(idx) else kinds[:j].count(ALLOC), peak_in)
        state[:] = [j, in_use, peak_in, peak_res, peak_at, dirty, largest, res_at_peak]


def recorded_run(trace: Trace) -> RecordedRun | None:
    """The recording allocator's own segment traffic in the window, or None without any."""
    if trace.format != "torch-snapshot" and not any(e.action in ("segment_alloc", "segment_free") for e in trace.events):
        return None
    reserved = start = sum(s.size for s in trace.initial_segments) or int(trace.meta.get("recorded_start_reserved", 0) or 0)
    in_use = sum(b.size for b in trace.initial_blocks if b.allocated)
    peak = reserved
    allocs = alloc_bytes = frees = free_bytes = 0
    sizes: dict[int, int] = {}
    ev, t, tin, tres = [], [], [], []
    for i, e in enumerate(trace.events):
        a = e.action
        if a == "segment_alloc":
            allocs += 1
            alloc_bytes += e.size
            reserved += e.size
            peak = max(peak, reserved)
        elif a == "segment_free":
            frees += 1
            free_bytes += e.size
            reserved -= e.size
        elif a == "alloc":
            sizes[e.addr] = e.size
            in_use += e.size
        elif a == "free":
            in_use -= sizes.pop(e.addr, e.size if e.size > 0 else 0)
        else:
            continue
        ev.append(i)
        t.append(e.time_us)
        tin.append(in_use)
        tres.append(reserved)
    return RecordedRun(allocs, alloc_bytes, frees, free_bytes, start, peak, reserved,
                       _downsample(ev, t, tin, tres, TIMELINE_POINTS))


# A progress bar: `bar(description, total)` is a context manager yielding `advance(n)`
# (the command line passes `jaxmem.reports.terminal.progress`; the traces layer draws nothing).
ProgressBar = Callable[[str, int], ContextManager[Callable[[int], None]]]


@contextlib.contextmanager
def _no_bar(description: str, total: int) -> Iterator[Callable[[int], None]]:
    yield lambda n=1: None


def replay(trace: Trace, allocators: list[str], *, capacity: int, progress: ProgressBar | bool | None = None,
           options: dict[str, dict[str, Any]] | None = None) -> ReplayReport:
    """Replay `trace` through each allocator in `allocators` on a device of `capacity` bytes.

    >>> from jaxmem.traces.model import Event, Trace
    >>> t = Trace([Event("alloc", 1, 1024, requested=1000), Event("free", 1, 1024)])
    >>> replay(t, ["caching"], capacity=1 << 30, progress=False).runs["caching"].device_alloc_bytes
    2097152

    Args:
        trace: from `load_trace`.
        allocators: names from ALLOCATORS ("caching", "caching-expandable", "bfc" at 75% of
            capacity preallocated, "bfc-growth", "platform").
        capacity: device bytes.
        progress: a `ProgressBar` to advance as the replays run (None or False: none).
        options: per-allocator extra options (e.g. {"caching": {"alloc_conf": "..."}}).
    Returns:
        A ReplayReport: one ReplayRun per allocator, and `recorded` for snapshot traces.
    """
    for name in allocators:
        if name not in ALLOCATORS:
            raise ConfigError(f"unknown allocator {name!r}; one of: {', '.join(ALLOCATORS)}")
    ops = _ops(trace)
    n = len(ops[0])
    runs: dict[str, ReplayRun] = {}
    bar = progress if callable(progress) else _no_bar
    with bar("replaying", n * len(allocators)) as advance:
        for name in allocators:
            done = [0]

            def tick(j: int, done: list[int] = done) -> None:
                advance(j - done[0])
                done[0] = j

            runs[name] = replay_one(trace, name, capacity=capacity, options=(options or {}).get(name), ops=ops,
                                    progress=tick)
            advance(n - done[0])
    settings = ""
    if trace.allocator_settings:
        from jaxmem.runtime.caching_config import config_from_settings

        settings = config_from_settings(trace.allocator_settings).describe()
    return ReplayReport(trace.source, trace.format, capacity, n, runs, recorded_run(trace), settings)
