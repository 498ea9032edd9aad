"""Placement: offsets in one arena for buffers with known live intervals.

Best fit over several orderings (by size, by duration, by area, by start), keeping the smallest
arena, as XLA's heap simulator does with its global decreasing-size best-fit heap. Each buffer
goes into the smallest gap among the already-placed buffers live at the same time; offsets are
256-aligned because sizes are. The no-fragmentation lower bound (max live bytes) is reported
next to the result by the caller.

    >>> placed = place([(0, 1, 256), (1, 2, 512), (3, 3, 256)])
    >>> placed.arena, placed.name
    (768, 'size')
"""

from __future__ import annotations

import random
from typing import NamedTuple, Sequence

import numpy as np

from jaxmem.compiler.stages import Span, live_profile


class Placement(NamedTuple):
    """Where each buffer goes: offsets (per buffer, in input order), the arena's bytes, and
    which ordering won."""

    offsets: list[int]
    arena: int
    name: str


MAX_RESTARTS = 24
RESTART_WORK = 4_000_000  # restarts * buffers**2 stays below this

ORDERINGS = {
    "size": lambda s, e, z, i: (-z, s, i),
    "area": lambda s, e, z, i: (-z * (e - s + 1), -z, i),
    "duration": lambda s, e, z, i: (-(e - s), -z, i),
    "start": lambda s, e, z, i: (s, -z, i),
}


# Up to this many placed buffers live beside a new one, its gap is found in plain Python
# (`_best_gap`); more, with numpy. Both give the same offset.
SMALL_OVERLAP = 48


def _best_gap(lows: list[int], highs: list[int], size: int) -> int:
    """Best fit among buffers [low, high) (sizes > 0): the offset of the smallest gap between
    them, in address order, that holds `size` bytes (the lowest such on ties), else the top."""
    best_gap, best_off = None, 0
    top = 0   # the highest end below the current buffer
    for lo, hi in sorted(zip(lows, highs), key=lambda b: b[0]):   # stable: as numpy's argsort
        gap = lo - top
        if gap >= size and (best_gap is None or gap < best_gap):
            best_gap, best_off = gap, top
        if hi > top:
            top = hi
    return best_off if best_gap is not None else top


def place_ordered(buffers: Sequence[Span], order: Sequence[int]) -> tuple[list[int], int]:
    """Best-fit placement of `buffers` (start, end, size) taken in `order`.

    **Returns:** (offset per buffer, arena bytes).
    """
    k = len(buffers)
    starts = np.empty(k, np.int64)
    ends = np.empty(k, np.int64)
    offs = np.empty(k, np.int64)
    sizes = np.empty(k, np.int64)
    offsets = [0] * k
    m = 0
    arena = 0
    for i in order:
        s, e, z = buffers[i]
        if z <= 0:
            continue
        off = 0
        if m:
            hits = np.flatnonzero((starts[:m] <= e) & (ends[:m] >= s))   # placed, live meanwhile
            if 0 < hits.size <= SMALL_OVERLAP:
                off = _best_gap(offs[hits].tolist(), (offs[hits] + sizes[hits]).tolist(), z)
            elif hits.size:
                o = offs[hits]
                idx = np.argsort(o, kind="stable")
                o = o[idx]
                top = np.maximum.accumulate(o + sizes[hits][idx])
                prev = np.empty_like(top)
                prev[0] = 0
                prev[1:] = top[:-1]
                gaps = o - prev
                fit = np.nonzero(gaps >= z)[0]
                if fit.size:
                    best = fit[np.argmin(gaps[fit])]
                    off = int(prev[best])
                else:
                    off = int(top[-1])
        starts[m], ends[m], offs[m], sizes[m] = s, e, off, z
        m += 1
        offsets[i] = off
        arena = max(arena, off + z)
    return offsets, arena


def place(
    buffers: Sequence[Span],
    orderings: Sequence[str] = ("size", "area", "duration", "start"),
    stop_at: int | None = None,
    restarts: int | None = None,
) -> Placement:
    """Try each ordering, then decreasing size with seeded noise, keep the smallest arena.

    **Arguments:** `buffers` as (start, end, size) with sizes 256-aligned; the orderings to try;
    `stop_at`, a size that cannot be beaten to stop early (default: the most bytes live at once); `restarts`, how
    many noisy size orders to try (default: as many as a fixed amount of work allows, since
    one placement costs about the square of the buffer count).

    **Returns:** a `Placement`.
    """
    if not buffers:
        return Placement([], 0, "none")
    if stop_at is None:
        # No placement beats the most bytes live at once: stop there (most heaps reach it
        # with the first ordering, and the restarts would only confirm it).
        stop_at = int(live_profile(buffers, max(e for _, e, _ in buffers)).max())
    best: Placement | None = None
    for name in orderings:
        keyf = ORDERINGS[name]
        order = sorted(range(len(buffers)), key=lambda i: keyf(*buffers[i], i))
        offsets, arena = place_ordered(buffers, order)
        if best is None or arena < best.arena:
            best = Placement(offsets, arena, name)
        if stop_at is not None and best.arena <= stop_at:
            return best
    if restarts is None:
        restarts = min(MAX_RESTARTS, RESTART_WORK // max(len(buffers), 1) ** 2)
    # Ties and near-ties in size decide much of best fit's fragmentation; shuffling sizes by up
    # to 30% explores them (seeded: the same buffers always give the same plan).
    rng = random.Random(0)
    for trial in range(restarts):
        noise = [rng.uniform(0.7, 1.3) for _ in buffers]
        order = sorted(range(len(buffers)), key=lambda i: (-buffers[i][2] * noise[i], i))
        offsets, arena = place_ordered(buffers, order)
        if arena < best.arena:  # type: ignore[union-attr]
            best = Placement(offsets, arena, f"size~{trial}")
        if stop_at is not None and best.arena <= stop_at:  # type: ignore[union-attr]
            break
    return best  # type: ignore[return-value]  # at least one ordering ran
