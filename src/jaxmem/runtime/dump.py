"""What a person needs to see of a pool: XLA's per-bin table and a one-line occupancy strip.

Both are built from a list of `Chunk`s (address order), so they work for any allocator.
`PoolOutOfMemory` is the `OutOfMemory` the pools raise: it carries both, built only when read.

    chunks = list(device.chunks())
    print(dump(chunks))
    # Bin (256 B): 3 chunks, 2 in use; 768 B in chunks, 512 B in use; largest free 256 B
    # occupancy: ****__________ ...
"""

from __future__ import annotations

import weakref
from typing import Callable

from jaxmem.errors import OutOfMemory
from jaxmem.runtime.allocator import Chunk
from jaxmem.units import format_size

MIN_ALLOCATION = 256
NUM_BINS = 21


def bin_for_size(size: int) -> int:
    """The BFC bin a chunk of `size` bytes belongs in: floor(log2(size / 256)), capped at 20.

    >>> bin_for_size(256), bin_for_size(511), bin_for_size(512), bin_for_size(1 << 40)
    (0, 0, 1, 20)
    """
    return min(NUM_BINS - 1, (max(size, MIN_ALLOCATION) >> 8).bit_length() - 1)


def bin_summary(chunks: list[Chunk]) -> list[dict[str, int]]:
    """One row per BFC bin (all 21), as XLA's out-of-memory dump counts them.

    >>> bin_summary([Chunk(0, 512, True, 0)])[1]["chunks_in_use"]
    1

    Returns:
        Rows with keys bin, min_size, chunks, chunks_in_use, bytes (in all its chunks),
        bytes_in_use, free_chunks, largest_free.
    """
    rows = [dict(bin=b, min_size=MIN_ALLOCATION << b, chunks=0, chunks_in_use=0, bytes=0,
                 bytes_in_use=0, free_chunks=0, largest_free=0) for b in range(NUM_BINS)]
    for chunk in chunks:
        row = rows[bin_for_size(chunk.size)]
        row["chunks"] += 1
        row["bytes"] += chunk.size
        if chunk.in_use:
            row["chunks_in_use"] += 1
            row["bytes_in_use"] += chunk.size
        elif chunk.size > row["largest_free"]:
            row["largest_free"] = chunk.size
        if not chunk.in_use:
            row["free_chunks"] += 1
    return rows


def occupancy(chunks: list[Chunk], width: int = 100) -> str:
    """One line over the pool's bytes, regions end to end: '*' where a cell is at least half
    in use, '_' otherwise.

    >>> occupancy([Chunk(0, 512, True, 0), Chunk(512, 512, False, 0)], width=4)
    '**__'

    Args:
        chunks: the pool's chunks, address order.
        width: characters in the line.
    """
    total = sum(c.size for c in chunks)
    if total == 0 or width <= 0:
        return ""
    # used[c] = bytes in use within cell c, scaled by width so the cell edges stay integers.
    used = [0] * width
    offset = 0
    for chunk in chunks:
        if chunk.in_use:
            lo, hi = offset * width, (offset + chunk.size) * width
            for cell in range(lo // total, min(width, -(-hi // total))):
                used[cell] += min(hi, (cell + 1) * total) - max(lo, cell * total)
        offset += chunk.size
    return "".join("*" if 2 * u >= total else "_" for u in used)


def dump(chunks: list[Chunk], width: int = 100) -> str:
    """The non-empty bins and the occupancy strip as text, like XLA's BFC dump."""
    lines = []
    for row in bin_summary(chunks):
        if row["chunks"]:
            lines.append(
                f"Bin ({format_size(row['min_size'])}): {row['chunks']} chunks, "
                f"{row['chunks_in_use']} in use; {format_size(row['bytes'])} in chunks, "
                f"{format_size(row['bytes_in_use'])} in use; largest free {format_size(row['largest_free'])}")
    lines.append("occupancy: " + occupancy(chunks, width))
    return "\n".join(lines)


class PoolOutOfMemory(OutOfMemory):
    """`OutOfMemory` whose `chunks`, `bins` and `occupancy` show the pool as it was when the
    allocation failed, built only when read.

    Copying a large pool at every failure would make failing cheap allocations expensive (RMM's
    benchmark recipe fails thousands of times and never looks). So the error reads the live
    pool, and the allocator calls `freeze()` before its pool next changes, if the error is
    still alive then (it keeps a weak reference).

    Args:
        message: the one-line message.
        chunks_now: returns the pool's chunks as they are now.
        details: requested, rounded, in_use, pool_bytes, limit, largest_free_block, fragmentation.
    """

    def __init__(self, message: str, chunks_now: Callable[[], list[Chunk]], **details: object) -> None:
        super().__init__(message, **details)
        self._chunks_now: Callable[[], list[Chunk]] | None = chunks_now
        self._chunks: list[Chunk] | None = None

    def freeze(self) -> None:
        """Take the chunks now; the allocator calls this before it changes the pool."""
        if self._chunks is None and self._chunks_now is not None:
            self._chunks = self._chunks_now()
        self._chunks_now = None

    @property
    def chunks(self) -> list[Chunk]:
        if self._chunks is None:
            self.freeze()
        return self._chunks or []

    @property
    def bins(self) -> list[dict[str, int]]:
        return bin_summary(self.chunks)

    @property
    def occupancy(self) -> str:
        return occupancy(self.chunks)

    def dump(self) -> str:
        """The per-bin table and the occupancy strip, as XLA prints after the message."""
        return dump(self.chunks)


class OomWatch:
    """The allocator's side of `PoolOutOfMemory`: remembers the last error weakly, and freezes
    it before the pool changes.

        if self._watch.pending:          # on every path that changes the pool
            self._watch.settle()
    """

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: weakref.ref | None = None

    def track(self, err: PoolOutOfMemory) -> PoolOutOfMemory:
        self.pending = weakref.ref(err)
        return err

    def settle(self) -> None:
        err = self.pending() if self.pending is not None else None
        self.pending = None
        if err is not None:
            err.freeze()
