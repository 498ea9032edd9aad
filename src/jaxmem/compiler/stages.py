"""The named types that pass between the planner's stages.

    program (`program.Program`) + `Roles`      what each value is to this plan
    fusion(program, order, roles) -> Fusion    which values are never stored, what each op reads
    scheduler(program, Analysis) -> order      every scheduler: the same inputs, a list of op indices
    liveness(program, order, Analysis) -> Liveness (`liveness.py`: buffer groups, intervals)
    placement(intervals) -> Placement          (`placement.py`: offsets, arena)

Adding a scheduler is one function `(program, analysis) -> order` and one entry in
`planner.SCHEDULERS`. Two primitives every stage shares live here too: `align` (a value's
bytes in the arena) and `live_profile` (the one live-bytes profile: fusion, liveness, checker,
`reports/analysis`, remat's model of XLA:CPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, NamedTuple

import numpy as np


def align(nbytes: int) -> int:
    """Bytes rounded up to the arena's 256-byte granularity."""
    return (nbytes + 255) & ~255


class Span(NamedTuple):
    """A buffer's extent in a schedule: live from position `start` to `end` inclusive, `size`
    bytes. The one span type: liveness, placement, the checker, the GPU model's heap and the
    reports pass spans as these (a plain `(start, end, size)` tuple is one too)."""

    start: int
    end: int
    size: int


def live_profile(spans: Iterable[Span], n: int) -> np.ndarray:
    """Live bytes at each position -1..n (array index p+1) of `spans`, each (start, end, size)
    live from start to end inclusive: the one live-bytes profile (liveness, fusion, checker,
    `reports/analysis`, remat)."""
    diff = np.zeros(n + 3, dtype=np.int64)
    table = np.array(spans if isinstance(spans, (list, tuple)) else list(spans), dtype=np.int64)
    if table.size:
        # one vectorised scatter-add per edge: the per-span Python loop was a hot spot of
        # every scored schedule
        np.add.at(diff, table[:, 0] + 1, table[:, 2])
        np.add.at(diff, table[:, 1] + 2, -table[:, 2])
    return np.cumsum(diff)[: n + 2]


@dataclass(frozen=True)
class Roles:
    """Per value (indexed by ValueId): where it lives, as far as this plan is concerned."""

    external: list[bool]   # outside the arena: a non-donated argument, or a loop body's result
                           # written straight into the loop's own buffer
    outputs: list[bool]    # a program output
    donated: list[bool]    # a donated argument (in the arena: outputs may take it over)
    carry_of: dict[int, int]  # loop body: new carry -> the old carry input sharing its buffer


@dataclass(frozen=True)
class Fusion:
    """The fusion analysis: per value, fused (never stored); per op, the stored values it reads
    once fused operands are computed inside it."""

    fused: list[bool]
    reads: list[list[int]]


@dataclass(frozen=True)
class Analysis:
    """What schedulers and liveness read besides the program: roles, fusion, loop scratch."""

    roles: Roles
    fusion: Fusion
    scratch: dict[int, int]    # op index -> bytes of its loop/cond body's own temporaries
