"""How XLA:GPU launches a reduction kernel: its kind (row or column) in the physical layout and,
for a column reduction, how many thread blocks it runs on.

XLA classifies a reduce by its operand's layout (xla/service/gpu/reduction_utils.cc,
GetReductionKindAndContiguousComponents): where the kept dimensions are the minor-most ones
(per-channel statistics of NHWC data, a bias gradient), it is a *column* reduction
`[major kept, reduced, minor kept]`; where a reduced dimension is minor-most, a *row*
reduction. A column reduction of at most `warp size * 128` reduced rows is race free
(ReductionIsRaceFree) and one kernel reads it all; a longer one is split by the tree reduction
rewriter into a first pass over many blocks. The column emitter
(xla/backends/gpu/codegen/emitters/reduction.cc, ColumnReductionFusion) gives each block 32
warps over 32 * `vector size` kept columns, so `[1, 4096, 256]` f32 runs on 4 blocks; where
the minor kept size divides the warp size, SmallColumnReductionFusion gives one block per
major kept row. Few blocks cannot saturate DRAM: the performance model caps a kernel's
bandwidth at blocks * clock * 32 B (gpu_performance_model_base.cc, AdjustBandwidth;
`performance.Device.block_bandwidth`).

    >>> column_reduction_blocks((64, 8, 8, 256), (0, 1, 2), (0, 1, 2, 3), 4)
    4
    >>> column_reduction_blocks((64, 8, 8, 256), (0, 1, 2), (0, 3, 1, 2), 4) is None   # NCHW: a row reduction
    True
"""

from __future__ import annotations

from typing import Sequence

from jaxmem.xla.gpu.model.ops import elements

WARP = 32                   # threads_per_warp of every NVIDIA target
COLUMN_TILING = 128         # reduction_utils.cc, GetReductionTiling: a column reduction's {1, 128, 1}
TILE = 32                   # reduction.cc: kTileSize


def reduction_dimensions(shape: Sequence[int], axes: Sequence[int],
                         order: Sequence[int]) -> tuple[bool, tuple[int, int, int]] | None:
    """(is a row reduction, its three contiguous components) as
    GetReductionKindAndContiguousComponents states them for a reduce over `axes` of an operand of
    `shape` laid out major-to-minor in `order`; None where neither the kept nor the reduced
    dimensions are consecutive (XLA's layout normalization rewrites those first). Size-one
    dimensions are left out (bitcasts to XLA)."""
    order = [d for d in order if shape[d] != 1]
    reduced = {d for d in axes if shape[d] != 1}
    kept = [d for d in order if d not in reduced]
    if not kept:
        return True, (1, 1, elements([shape[d] for d in order]))

    def consecutive(dims: set[int]) -> bool:
        pos = sorted(order.index(d) for d in dims)
        return bool(pos) and pos[-1] - pos[0] + 1 == len(pos)

    def partition(middle: set[int]) -> list[int]:
        values, segment = [1, 1, 1], 2          # major, middle, minor; walked minor to major
        for d in reversed(order):
            if segment == 2 and d in middle:
                segment = 1
            elif segment == 1 and d not in middle:
                segment = 0
            values[segment] *= shape[d]
        return values

    if consecutive(set(kept)):
        major, middle, minor = partition(set(kept))
        if middle == 1:
            return True, (1, 1, major * minor)
        if minor == 1:
            return False, (1, major, middle)
        return True, (major, middle, minor)
    if consecutive(reduced):
        major, middle, minor = partition(reduced)
        if minor == 1:
            return True, (1, major, middle)
        return False, (major, middle, minor)
    return None


def column_vector_size(minor_kept: int, itemsize: int) -> int:
    """reduction_base.cc, GetVectorSizeForMlir for a column reduction (32 threads along the kept
    dimension)."""
    if minor_kept % 2 or TILE * 2 > minor_kept:
        return 1
    if itemsize >= 4:
        return 2
    if TILE * 4 > minor_kept:
        return 2
    return 4 if minor_kept % 4 == 0 else 2


def column_reduction_blocks(shape: Sequence[int], axes: Sequence[int], order: Sequence[int],
                            itemsize: int) -> int | None:
    """The blocks XLA's column reduction emitter launches for this reduce (see the module's
    text); None where it is a row reduction, one the loop emitter runs
    (IsUnnestedReductionFasterThanElemental), or one the tree reduction rewriter splits."""
    kind = reduction_dimensions(shape, axes, order)
    if kind is None or kind[0]:
        return None
    major, reduced, minor = kind[1]
    elemental = (reduced < WARP or (reduced < 2 * WARP and minor < WARP) or (reduced < 4 * WARP and minor < 8)
                 or (reduced < 8 * WARP and minor < 3))
    if elemental or reduced > WARP * COLUMN_TILING:
        return None
    if WARP % minor == 0:
        return major
    return major * -(-minor // (TILE * column_vector_size(minor, itemsize)))
