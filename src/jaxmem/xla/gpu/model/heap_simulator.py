"""XLA's placement of temporaries in its heap, as buffer assignment does it.

XLA's buffer assignment packs the temporaries left after output-allocation reuse into one
block with its heap simulator (heap_simulator.cc). It runs two placements and keeps the
smaller (ChooseBestHeapAlgorithm over two ConstrainedGlobalDecreasingSizeBestFitHeap):

- **spatial**: buffers by size (descending), then live duration (descending);
- **temporal**: by live duration (descending), then size (descending);

each buffer, in that order, goes into the smallest free gap among the already placed buffers
live at the same time (ties: the lower offset), or on top of them when none fits.

Times are the heap simulator's own clock: every allocation and every free is one tick
(GlobalDecreasingSizeBestFitHeap::Alloc / Free advance `current_time_`), with the
allocations of one instruction before its frees. Overlap in time is the same as over
schedule positions; durations, which order the temporal placement, count events.

This is less than jaxmem's own placement (`compiler.placement.place`), which tries more
orders and stops at the lower bound: XLA leaves the fragmentation these two orders leave.

    >>> xla_heap_size([(0, 1, 256), (1, 2, 512), (3, 3, 256)])
    768
"""

from __future__ import annotations

from typing import Sequence

from jaxmem.compiler.placement import place_ordered
from jaxmem.compiler.stages import Span


def event_times(spans: Sequence[Span]) -> list[tuple[int, int]]:
    """(alloc tick, free tick) per span: at each schedule position the allocations (ordered
    by start, end, then index, as HeapSimulator::RunComputation sorts its values), then the
    frees in the same order.

    >>> event_times([(0, 0, 256), (0, 1, 256)])
    [(0, 2), (1, 3)]
    """
    order = sorted(range(len(spans)), key=lambda i: (spans[i][0], spans[i][1], i))
    events: list[tuple[int, int, int]] = []   # (position, phase, rank): phase 0 alloc, 1 free
    for rank, i in enumerate(order):
        s, e, _ = spans[i]
        events.append((s, 0, rank))
        events.append((e, 1, rank))
    events.sort()
    alloc = [0] * len(spans)
    free = [0] * len(spans)
    for tick, (_, phase, rank) in enumerate(events):
        (free if phase else alloc)[order[rank]] = tick
    return list(zip(alloc, free))


def placements(spans: Sequence[Span],
               ids: Sequence[int] | None = None) -> dict[str, tuple[list[int], int]]:
    """XLA's two placements of (start, end, size) spans (inclusive schedule positions, sizes
    aligned): per name ('spatial', 'temporal'), the offset of each span and the heap's size.

    **Arguments:** the spans; `ids`, XLA's value ids, which break ties (default: the spans'
    start, as values are numbered in definition order, then their index).
    """
    ticks = event_times(spans)
    tie = list(ids) if ids is not None else [ticks[i][0] for i in range(len(spans))]
    keys = {"spatial": lambda i: (-spans[i][2], ticks[i][0] - ticks[i][1], tie[i], i),
            "temporal": lambda i: (ticks[i][0] - ticks[i][1], -spans[i][2], tie[i], i)}
    return {name: place_ordered(spans, sorted(range(len(spans)), key=key)) for name, key in keys.items()}


def xla_heap_size(spans: Sequence[Span]) -> int:
    """The heap's size when XLA places these (start, end, size) spans: the smaller of its
    spatial and temporal placements (`placements`)."""
    spans = [sp for sp in spans if sp[2] > 0]
    if not spans:
        return 0
    return min(size for _, size in placements(spans).values())


def dump_temp_spans(assignment_text: str, live_range_text: str) -> tuple[list[Span], list[int], list[int], int]:
    """XLA's own temporaries from its dumps (`*-buffer-assignment.txt`, `*-live-range.txt`):
    one span per buffer of the temp allocation (values at one offset whose live ranges touch
    share a buffer: an op written in place), its offset and value id, and the allocation's size.
    Tuple tables are left out: they are placed after the heap, above it (the allocation's size
    holds them; the heap's is the allocation's less theirs).

    **Returns:** (spans as (start, end, size), offsets, ids, temp allocation bytes); sizes as
    XLA's (not rounded).
    """
    import re

    found = re.search(r"allocation \d+: size (\d+), preallocated-temp:\n((?: value:.*\n)+)", assignment_text)
    if found is None:
        return [], [], [], 0
    ranges = {}
    for m in re.finditer(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$", live_range_text, re.M):
        ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    at_offset: dict[int, list[list[int]]] = {}
    # A tuple's pointer table (shape text "(...)") is no value of the heap simulation: XLA gives
    # each its own small temp allocation, which CombineTempAllocations (buffer_assignment.cc) then
    # stacks above the heap's result; counted in the clock, its ticks would reorder equal sizes.
    for m in re.finditer(r"value: <(\d+) (\S+?)(?:\{([\d,]*)\})? @0> \(size=(\d+),offset=(\d+)\): (?!\()",
                         found.group(2)):
        key = f"{m.group(2)}{{{m.group(3) or ''}}}"
        if key in ranges:
            at_offset.setdefault(int(m.group(5)), []).append([*ranges[key], int(m.group(4)), int(m.group(1))])
    spans, offsets, ids = [], [], []
    for offset, values in at_offset.items():
        values.sort()
        groups = [values[0][:]]
        for start, end, size, vid in values[1:]:
            last = groups[-1]
            if start <= last[1]:   # written in place of the value before it
                last[1], last[2] = max(last[1], end), max(last[2], size)
            else:
                groups.append([start, end, size, vid])
        for start, end, size, vid in groups:
            spans.append((start, end, size))
            offsets.append(offset)
            ids.append(vid)
    return spans, offsets, ids, int(found.group(1))
