"""The BFC pool's fast paths against its generic ones: the fused public allocate against the
hook-based `Allocator.allocate`, and the lazily written out-of-memory message against the
pool's state at the failure."""

from __future__ import annotations

import random

import pytest

from jaxmem.errors import OutOfMemory
from jaxmem.runtime.allocator import Allocator
from jaxmem.runtime.backends import SimulatedBackend
from jaxmem.runtime.bfc import BFCAllocator
from jaxmem.units import MiB, format_size


class GenericBFC(BFCAllocator):
    """BFC through the generic public pair: overriding the hook makes the fused allocate step aside."""

    def _allocate(self, size, alignment, stream):
        return super()._allocate(size, alignment, stream)


def test_a_subclass_that_overrides_the_hook_gets_the_generic_allocate():
    assert GenericBFC.allocate is Allocator.allocate
    assert BFCAllocator.allocate is not Allocator.allocate


@pytest.mark.parametrize("preallocate", [True, False])
@pytest.mark.parametrize("max_size", [64 << 10, 4 * MiB, 300 * MiB])
def test_fused_allocate_places_every_buffer_as_the_generic_path(preallocate, max_size):
    rng = random.Random(max_size + preallocate)
    limit = 1 << 30
    fast = BFCAllocator(SimulatedBackend(4 << 30), limit, preallocate=preallocate)
    slow = GenericBFC(SimulatedBackend(4 << 30), limit, preallocate=preallocate)
    live: list[tuple] = []
    for step in range(3000):
        if live and (rng.random() < 0.45 or step > 2600):
            a, b = live.pop(rng.randrange(len(live)))
            fast.free(a)
            slow.free(b)
        else:
            size = rng.randint(1, max_size)
            alignment = rng.choice([256, 256, 256, 128, 4096])
            outcome = []
            for pool in (fast, slow):
                try:
                    outcome.append(pool.allocate(size, alignment=alignment))
                except OutOfMemory as err:
                    outcome.append(str(err))
            a, b = outcome
            if isinstance(a, str):
                assert a == b
                continue
            assert (a.address, a.size, a.requested_size, a.stream, a.live, a.handle) == \
                   (b.address, b.size, b.requested_size, b.stream, b.live, b.handle)
            assert a.owner is fast and b.owner is slow
            live.append((a, b))
        if step % 50 == 0:
            assert list(fast.chunks()) == list(slow.chunks())
            assert fast.memory_stats() == slow.memory_stats()
    assert list(fast.chunks()) == list(slow.chunks())
    assert fast.memory_stats() == slow.memory_stats()


def _failing_pool():
    pool = BFCAllocator(SimulatedBackend(1 << 30), 64 * MiB)
    keep = [pool.allocate(4 * MiB) for _ in range(16)]
    for buf in keep[::2]:
        pool.free(buf)          # 32 MiB free in 4 MiB holes
    return pool


def test_out_of_memory_message_is_the_state_at_the_failure_whenever_read():
    pool = _failing_pool()
    stats = pool.memory_stats()
    with pytest.raises(OutOfMemory) as info:
        pool.allocate(5 * MiB + 1)
    err = info.value
    pool.free(pool.allocate(MiB))       # the pool changes before anyone reads the message
    message = str(err)
    assert message.startswith(f"bfc ran out of memory trying to allocate {format_size(5 * MiB + 1)} "
                              f"({5 * MiB + 1} bytes, rounded to {5 * MiB + 256})")
    assert f"in use {format_size(stats['bytes_in_use'])}" in message
    assert f"pool {format_size(stats['pool_bytes'])} of limit {format_size(stats['bytes_limit'])}" in message
    assert f"largest free block {format_size(stats['largest_free_block_bytes'])}" in message
    assert "cause: fragmentation (32.00 MiB free" in message
    assert err.args == (message,) and message in repr(err)
    # the same failure on a twin pool, read at once, says the same
    twin = _failing_pool()
    with pytest.raises(OutOfMemory) as again:
        twin.allocate(5 * MiB + 1)
    assert str(again.value) == message and again.value.args == err.args
    assert (err.requested, err.rounded, err.fragmentation) == (5 * MiB + 1, 5 * MiB + 256, True)


def test_bfc_out_of_memory_is_what_the_generic_constructors_build():
    """BFCOutOfMemory sets its state in one go: it must equal what PoolOutOfMemory's own
    constructor chain leaves, so the two cannot drift apart."""
    from jaxmem.runtime.bfc import BFCOutOfMemory
    from jaxmem.runtime.dump import PoolOutOfMemory

    pool = _failing_pool()
    with pytest.raises(BFCOutOfMemory) as info:
        pool.allocate(5 * MiB + 1)
    err = info.value
    generic = PoolOutOfMemory(str(err), lambda: list(pool.chunks()), **err.details)
    mine = {k: v for k, v in vars(err).items() if k not in ("_pool_name", "_chunks_now", "_chunks")}
    theirs = {k: v for k, v in vars(generic).items() if k not in ("_chunks_now", "_chunks")}
    assert mine == theirs
    assert set(vars(err)) - {"_pool_name"} == set(vars(generic))
    assert err.args == generic.args and str(err) == str(generic)
    assert err.chunks == generic.chunks and err.bins == generic.bins and err.occupancy == generic.occupancy
    assert isinstance(err, OutOfMemory) and isinstance(err, MemoryError)


def test_an_error_frozen_by_a_free_shows_the_freed_buffer_still_in_use():
    """The public free lists buffers apart from the hooks' table: the chunk walk an
    out-of-memory error takes on the next change must still see the buffer being freed."""
    pool = _failing_pool()
    with pytest.raises(OutOfMemory) as info:
        pool.allocate(5 * MiB + 1)
    before = [c for c in pool.chunks()]
    victim = next(b for b in _live_buffers(pool) if b.size == 4 * MiB)
    pool.free(victim)                    # the first change after the failure is a free
    assert info.value.chunks == before
    assert any(c.address == victim.address and c.in_use for c in info.value.chunks)
    assert not any(c.address == victim.address and c.in_use for c in pool.chunks())


def _live_buffers(pool):
    return [b for b in pool._issued if b.live]


@pytest.mark.parametrize("preallocate", [True, False])
def test_chunk_walk_matches_the_live_buffers_across_sweeps(preallocate):
    """Thousands of allocations: freed buffers are swept from the pool's list now and then;
    the used chunks must stay exactly the live buffers (a brute-force set kept here)."""
    rng = random.Random(7 + preallocate)
    pool = BFCAllocator(SimulatedBackend(8 << 30), 4 << 30, preallocate=preallocate)
    live: list = []
    longest = most_live = 0
    for step in range(12_000):
        if live and rng.random() < 0.48:
            pool.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(pool.allocate(rng.randint(1, 2 * MiB)))
        longest = max(longest, len(pool._issued))
        most_live = max(most_live, len(live))
        if step % 2000 == 1999:
            used = sorted((c.address, c.size) for c in pool.chunks() if c.in_use)
            assert used == sorted((b.address, b.size) for b in live)
    assert longest <= 2 * most_live + 1024 + 1     # swept, not growing with the steps
    for buf in live:
        pool.free(buf)
    assert [c.in_use for c in pool.chunks()].count(True) == 0
