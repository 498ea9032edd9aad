"""The BFC pool's out-of-memory error fills in its attributes on first read: whatever is read
first, the error must then equal what `PoolOutOfMemory`'s own constructor builds from the
pool's state at the failure, even when the pool has changed since."""

from __future__ import annotations

import pytest

from jaxmem.errors import OutOfMemory
from jaxmem.runtime.backends import SimulatedBackend
from jaxmem.runtime.bfc import BFCAllocator, BFCOutOfMemory
from jaxmem.runtime.dump import PoolOutOfMemory
from jaxmem.units import MiB


def _fail(preallocate: bool) -> tuple[BFCAllocator, BFCOutOfMemory, dict, list]:
    pool = BFCAllocator(SimulatedBackend(1 << 30), 64 * MiB, preallocate=preallocate)
    keep = [pool.allocate(4 * MiB) for _ in range(16)]
    for buf in keep[::2]:
        pool.free(buf)                  # 32 MiB free in 4 MiB holes: fragmentation
    stats, chunks = pool.memory_stats(), list(pool.chunks())
    with pytest.raises(BFCOutOfMemory) as info:
        pool.allocate(5 * MiB + 1)
    return pool, info.value, stats, chunks


READS = ["requested", "details", "fragmentation", "args", "str", "repr", "chunks", "bins", "freeze"]


@pytest.mark.parametrize("preallocate", [True, False])
@pytest.mark.parametrize("first", READS)
def test_any_first_read_fills_the_error_as_the_generic_constructor(first, preallocate):
    pool, err, stats, chunks = _fail(preallocate)
    pool.free(pool.allocate(MiB))       # the pool changes before the error is read
    if first in ("str", "repr"):
        {"str": str, "repr": repr}[first](err)
    elif first == "freeze":
        err.freeze()
    else:
        getattr(err, first)
    expected = {"requested": 5 * MiB + 1, "rounded": 5 * MiB + 256, "in_use": stats["bytes_in_use"],
                "pool_bytes": stats["pool_bytes"], "limit": stats["bytes_limit"],
                "largest_free_block": stats["largest_free_block_bytes"], "fragmentation": True}
    assert err.details == expected
    assert all(getattr(err, k) == v for k, v in expected.items())
    generic = PoolOutOfMemory(str(err), lambda: chunks, **expected)
    mine = {k: v for k, v in vars(err).items() if k not in ("_pool_name", "_chunks_now", "_chunks")}
    theirs = {k: v for k, v in vars(generic).items() if k not in ("_chunks_now", "_chunks")}
    assert mine == theirs
    assert err.args == generic.args and str(err) == str(generic)
    assert err.chunks == chunks == generic.chunks       # the pool at the failure, not now
    assert err.bins == generic.bins and err.occupancy == generic.occupancy


def test_a_missing_attribute_is_still_an_attribute_error():
    _, err, _, _ = _fail(True)
    assert not hasattr(err, "no_such_attribute")
    assert err.requested == 5 * MiB + 1          # the failed lookup filled the rest in
    with pytest.raises(AttributeError, match="no_such_attribute"):
        err.no_such_attribute
    assert isinstance(err, OutOfMemory) and isinstance(err, MemoryError)
