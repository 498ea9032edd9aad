"""The contract every allocator keeps, run over each factory in conftest.FACTORIES."""

from __future__ import annotations

import random

import pytest

from jaxmem.errors import AllocationError, OutOfMemory
from jaxmem.runtime.allocator import Buffer
from jaxmem.units import MiB

from runtime_checks import POOLED, check_invariants, check_regions


def test_allocate_and_free_roundtrip(factory):
    alloc = factory(64 * MiB)
    buf = alloc.allocate(1000)
    assert isinstance(buf, Buffer) and buf.live
    assert buf.requested_size == 1000 and buf.size >= 1000 and buf.address % 256 == 0
    check_invariants(alloc, [buf])
    alloc.free(buf)
    assert not buf.live
    check_invariants(alloc, [])
    stats = alloc.memory_stats()
    assert stats["num_allocs"] == 1 and stats["bytes_in_use"] == 0
    assert stats["peak_bytes_in_use"] == buf.size and stats["largest_alloc_size"] == buf.size


def test_stats_keys_are_jax_keys(factory):
    keys = {"num_allocs", "bytes_in_use", "peak_bytes_in_use", "largest_alloc_size", "bytes_limit",
            "bytes_reserved", "peak_bytes_reserved", "bytes_reservable_limit",
            "largest_free_block_bytes", "pool_bytes", "peak_pool_bytes", "fragmentation"}
    assert set(factory(8 * MiB).memory_stats()) == keys


def test_random_workload_keeps_invariants(factory):
    rng = random.Random(7)
    alloc = factory(256 * MiB)
    live = []
    for step in range(400):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            size = rng.choice([rng.randint(1, 4096), rng.randint(1, 2 * MiB), rng.randint(1, 24 * MiB)])
            try:
                live.append(alloc.allocate(size))
            except OutOfMemory:
                pass
        if step % 10 == 0:
            check_invariants(alloc, live)
            check_regions(alloc)
    for buf in live:
        alloc.free(buf)
    check_invariants(alloc, [])


def test_reset_peak_stats(factory):
    alloc = factory(64 * MiB)
    a, b = alloc.allocate(MiB), alloc.allocate(MiB)
    alloc.free(a)
    assert alloc.memory_stats()["peak_bytes_in_use"] == a.size + b.size
    alloc.reset_peak_stats()
    stats = alloc.memory_stats()
    assert stats["peak_bytes_in_use"] == stats["bytes_in_use"] == b.size
    assert stats["peak_pool_bytes"] == stats["pool_bytes"]


def _snapshot(alloc):
    return list(alloc.chunks()), alloc.memory_stats(), alloc.backend.reserved, dict(alloc.backend.allocations)


@pytest.mark.parametrize("size", [0, -1, 1.5, "10", True, None])
def test_bad_size_is_refused_and_changes_nothing(factory, size):
    alloc = factory(16 * MiB)
    keep = alloc.allocate(4096)
    before = _snapshot(alloc)
    with pytest.raises(AllocationError, match="size"):
        alloc.allocate(size)
    assert _snapshot(alloc) == before


@pytest.mark.parametrize("alignment", [0, -256, 3, 384, 1000])
def test_bad_alignment_is_refused_and_changes_nothing(factory, alignment):
    alloc = factory(16 * MiB)
    before = _snapshot(alloc)
    with pytest.raises(AllocationError, match="alignment"):
        alloc.allocate(100, alignment=alignment)
    assert _snapshot(alloc) == before


@pytest.mark.parametrize("alignment", [1, 64, 256, 512, 4096, 1 << 20])
def test_alignment_is_honoured(factory, alignment):
    alloc = factory(64 * MiB)
    live = [alloc.allocate(300)]  # misalign whatever comes next
    for size in (1, 1000, 5000, 70000):
        buf = alloc.allocate(size, alignment=alignment)
        assert buf.address % max(alignment, 256) == 0
        live.append(buf)
        check_invariants(alloc, live)


def test_double_free_is_refused_and_changes_nothing(factory):
    alloc = factory(16 * MiB)
    a, b = alloc.allocate(1000), alloc.allocate(2000)
    alloc.free(a)
    before = _snapshot(alloc)
    with pytest.raises(AllocationError, match="double free"):
        alloc.free(a)
    assert _snapshot(alloc) == before
    check_invariants(alloc, [b])


def test_free_on_another_device_is_refused(factory):
    mine, other = factory(16 * MiB), factory(16 * MiB)
    buf = other.allocate(1000)
    mine.allocate(1000)
    before = _snapshot(mine)
    with pytest.raises(AllocationError, match="not allocated by"):
        mine.free(buf)
    with pytest.raises(AllocationError, match="Buffer"):
        mine.free(buf.address)
    assert _snapshot(mine) == before and buf.live


def test_out_of_memory_changes_nothing_and_says_why(factory):
    alloc = factory(64 * MiB, limit=32 * MiB)
    live = [alloc.allocate(3 * MiB) for _ in range(6)]
    before = _snapshot(alloc)
    with pytest.raises(OutOfMemory) as info:
        alloc.allocate(40 * MiB)
    assert _snapshot(alloc) == before
    err = info.value
    assert isinstance(err, MemoryError)
    assert err.requested == 40 * MiB and err.rounded >= err.requested
    assert err.in_use == alloc.memory_stats()["bytes_in_use"]
    assert err.limit == 32 * MiB and err.pool_bytes == alloc.memory_stats()["pool_bytes"]
    message = str(err)
    assert "\n" not in message and str(40 * MiB) in message
    assert set(err.occupancy) <= {"*", "_"}
    assert sum(row["chunks"] for row in err.bins) == len(before[0])
    check_invariants(alloc, live)


def test_pool_is_one_free_chunk_after_everything_is_freed(factory):
    alloc = factory(128 * MiB)
    rng = random.Random(3)
    live = [alloc.allocate(rng.randint(1, 3 * MiB)) for _ in range(30)]
    rng.shuffle(live)
    for buf in live:
        alloc.free(buf)
    chunks = list(alloc.chunks())
    if alloc.name == "bfc":
        assert len(chunks) == 1 and not chunks[0].in_use
    elif alloc.name == "platform":
        assert chunks == [] and alloc.backend.reserved == 0
    else:
        assert all(not c.in_use for c in chunks)
        assert len({c.region for c in chunks}) == len(chunks)  # one free chunk per region


def test_empty_cache_returns_only_wholly_free_regions(factory):
    alloc = factory(256 * MiB)
    live = [alloc.allocate(MiB) for _ in range(20)]
    for buf in live[::2]:
        alloc.free(buf)
    kept = live[1::2]
    in_use = alloc.memory_stats()["bytes_in_use"]
    alloc.empty_cache()
    check_invariants(alloc, kept)
    check_regions(alloc)
    assert alloc.memory_stats()["bytes_in_use"] == in_use
    for buf in kept:
        alloc.free(buf)
    released = alloc.empty_cache()
    stats = alloc.memory_stats()
    if alloc.name in POOLED and alloc.preallocate:
        assert released == 0 and stats["pool_bytes"] == stats["bytes_limit"]
    else:
        assert stats["pool_bytes"] == 0 and alloc.backend.reserved == 0


def test_replay_pair_places_like_the_public_pair_and_settles_the_statistics(factory):
    """The replay verbs (replay_pair, settle_replay) keep the pool's invariants and, once
    settled, the same statistics as the public allocate/free would."""
    alloc = factory(64 * MiB)
    pair = alloc.replay_pair()
    sizes = [1000, 5000, 300, 70000]
    if pair.blocks:
        entries = [pair.allocate(size, 0) for size in sizes]
        reserved = [e.size for e in entries]
        addresses = [e.addr for e in entries]
    else:
        entries = [pair.allocate(size, 256, 0) for size in sizes]
        reserved = [e[1] for e in entries]
        addresses = [e[0] for e in entries]
    assert all(r >= s for r, s in zip(reserved, sizes)) and len(set(addresses)) == len(sizes)
    alloc.settle_replay(sum(reserved), len(sizes), sum(reserved))
    stats = alloc.memory_stats()
    assert (stats["num_allocs"], stats["bytes_in_use"], stats["peak_bytes_in_use"]) == (4, sum(reserved), sum(reserved))
    for e in entries:
        pair.free(e) if pair.blocks else pair.free(e[0], e[1], e[2], 0)
    alloc.settle_replay(0, 0, sum(reserved))
    check_invariants(alloc, [])
    assert alloc.memory_stats()["bytes_in_use"] == 0
    assert alloc.release_segment_at(-1) is False
