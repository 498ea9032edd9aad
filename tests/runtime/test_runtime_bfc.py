"""BFC's XLA behaviour pinned on hand-made cases, and checked against a brute-force model."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings, strategies as st

from jaxmem.errors import OutOfMemory
from jaxmem.runtime.backends import SimulatedBackend
from jaxmem.runtime.bfc import BFCAllocator, bin_for_size, round_bytes
from jaxmem.runtime.dump import occupancy
from jaxmem.units import MiB


class RecordingBackend(SimulatedBackend):
    """A simulated device that logs every reserve it is asked for, and can refuse some."""

    def __init__(self, capacity, refuse_above=None):
        super().__init__(capacity)
        self.asked: list[int] = []
        self.refuse_above = refuse_above

    def reserve(self, size, alignment=256):
        self.asked.append(size)
        if self.refuse_above is not None and size > self.refuse_above:
            return None
        return super().reserve(size, alignment)


def pool(limit, *, preallocate=True, capacity=None, backend=None):
    backend = backend or SimulatedBackend(capacity or max(limit, 1 << 30))
    return BFCAllocator(backend, limit, preallocate=preallocate)


# ---- rounding and bins --------------------------------------------------------------------
@pytest.mark.parametrize("size,rounded", [(1, 256), (255, 256), (256, 256), (257, 512), (1000, 1024),
                                          (MiB - 1, MiB), (MiB + 1, MiB + 256)])
def test_sizes_round_up_to_256(size, rounded):
    assert round_bytes(size) == rounded
    # a fresh pool splits its one chunk, so the buffer gets exactly the rounded size
    assert pool(64 * MiB).allocate(size).size == rounded


def test_bins_are_powers_of_two_from_256():
    for b in range(20):
        lo = 256 << b
        assert bin_for_size(lo) == b and bin_for_size(2 * lo - 256) == b
    assert bin_for_size(256 << 20) == 20 and bin_for_size(1 << 40) == 20  # last bin: 256 MiB up


def _holes(alloc, sizes):
    """Free chunks of the given sizes, in address order, each walled in by a 256-byte buffer."""
    holes, walls = [], []
    for size in sizes:
        holes.append(alloc.allocate(size))
        walls.append(alloc.allocate(256))
    starts = [h.address for h in holes]
    for h in holes:
        alloc.free(h)
    return starts, walls


def test_best_fit_takes_smallest_chunk_that_fits_lowest_address_on_ties():
    alloc = pool(64 * MiB)
    starts, _ = _holes(alloc, [8192, 2048, 4096, 2048, 1024])
    assert alloc.allocate(1500).address == starts[1]      # 2048s tie: the lower one
    assert alloc.allocate(1500).address == starts[3]
    assert alloc.allocate(3000).address == starts[2]      # 4096 before 8192
    assert alloc.allocate(700).address == starts[4]       # 1024 (bin 2)
    assert alloc.allocate(5000).address == starts[0]


def test_search_moves_up_the_bins_when_the_requests_bin_has_nothing_big_enough():
    alloc = pool(64 * MiB)
    # 3000 and 3500 share bin 3 ([2048, 4096)); a 3584-byte request does not fit the 3072 chunk
    starts, _ = _holes(alloc, [3072, 3584 + 4096, 3584])
    assert alloc.allocate(3584).address == starts[2]
    assert alloc.allocate(3300).address == starts[1]      # next bin up, the only one left


# ---- the split rule -----------------------------------------------------------------------
def test_split_when_chunk_is_at_least_twice_the_request():
    alloc = pool(64 * MiB)
    (start,), _ = _holes(alloc, [1024])
    buf = alloc.allocate(512)                # 1024 >= 2 * 512: split
    assert (buf.address, buf.size) == (start, 512)
    nxt = alloc.allocate(512)
    assert (nxt.address, nxt.size) == (start + 512, 512)


def test_no_split_when_chunk_is_under_twice_and_leftover_small():
    alloc = pool(64 * MiB)
    (start,), _ = _holes(alloc, [1024])
    buf = alloc.allocate(600)                # rounds to 768; 1024 < 1536, leftover 256: whole chunk
    assert (buf.address, buf.size, buf.requested_size) == (start, 1024, 600)
    assert alloc.memory_stats()["bytes_in_use"] == 1024 + 256


def test_split_anyway_when_leftover_is_128_mib_or_more():
    alloc = pool(2048 * MiB, capacity=4096 * MiB)
    (a, b), _ = _holes(alloc, [300 * MiB, 400 * MiB])
    small = alloc.allocate(250 * MiB)        # 300 MiB chunk: < 2x, leftover 50 MiB -> whole chunk
    assert (small.address, small.size) == (a, 300 * MiB)
    big = alloc.allocate(250 * MiB)          # 400 MiB chunk: leftover 150 MiB >= 128 MiB -> split
    assert (big.address, big.size) == (b, 250 * MiB)
    rest = alloc.allocate(150 * MiB)
    assert rest.address == b + 250 * MiB


# ---- merging ------------------------------------------------------------------------------
def test_free_merges_with_both_neighbours_at_once():
    alloc = pool(16 * MiB)
    a, b, c, wall = (alloc.allocate(1024) for _ in range(4))
    alloc.free(a)
    alloc.free(c)
    alloc.free(b)                            # joins a and c into one 3072-byte chunk
    chunks = list(alloc.chunks())
    assert chunks[0].address == a.address and chunks[0].size == 3072 and not chunks[0].in_use
    assert alloc.allocate(3072).address == a.address


# ---- preallocation and growth -------------------------------------------------------------
def test_preallocated_pool_is_one_region_of_the_limit_at_creation():
    backend = RecordingBackend(1 << 30)
    alloc = BFCAllocator(backend, 768 * MiB + 100, preallocate=True)
    # the region is the limit rounded down to 256 bytes (what Extend finds available)
    assert backend.asked == [768 * MiB] and alloc.device_allocs == 1
    assert [(c.address, c.size, c.in_use) for c in alloc.chunks()] == [(0, 768 * MiB, False)]
    assert alloc.memory_stats()["pool_bytes"] == 768 * MiB


def test_growth_regions_are_2_4_8_mib():
    backend = RecordingBackend(1 << 30)
    alloc = BFCAllocator(backend, 512 * MiB, preallocate=False)
    assert backend.asked == [] and alloc.memory_stats()["pool_bytes"] == 0
    live = [alloc.allocate(MiB) for _ in range(15)]
    assert backend.asked == [2 * MiB, 4 * MiB, 8 * MiB, 16 * MiB]
    assert alloc.device_allocs == 4 and alloc.device_alloc_bytes == 30 * MiB
    assert len(live) == 15


def test_growth_region_grows_to_fit_a_large_request_then_keeps_doubling():
    backend = RecordingBackend(1 << 30)
    alloc = BFCAllocator(backend, 512 * MiB, preallocate=False)
    alloc.allocate(5 * MiB)                  # 2 MiB doubles to 8 MiB to fit; no extra doubling
    alloc.allocate(5 * MiB)
    alloc.allocate(5 * MiB)
    assert backend.asked == [8 * MiB, 8 * MiB, 16 * MiB]


def test_growth_backs_off_by_0_9_down_to_the_request():
    backend = RecordingBackend(1 << 30, refuse_above=5 * MiB)
    alloc = BFCAllocator(backend, 512 * MiB, preallocate=False)
    alloc.allocate(MiB)                      # 2 MiB region, split
    alloc.allocate(MiB)
    alloc.allocate(MiB)                      # 4 MiB region
    alloc.allocate(3 * MiB)
    backend.asked.clear()
    alloc.allocate(MiB)                      # wants 8 MiB: refused, then 0.9x steps
    expected, size = [8 * MiB], 8 * MiB
    while size > 5 * MiB:
        size = round_bytes(int(size * 0.9))
        expected.append(size)
    assert backend.asked == expected and expected[-1] <= 5 * MiB < expected[-2]


def test_backoff_gives_up_below_the_request_and_changes_nothing():
    backend = RecordingBackend(1 << 30, refuse_above=3 * MiB)
    alloc = BFCAllocator(backend, 512 * MiB, preallocate=False)
    before = list(alloc.chunks()), alloc.memory_stats(), alloc.curr_region_bytes
    with pytest.raises(OutOfMemory):
        alloc.allocate(4 * MiB)              # 4 MiB region refused; 0.9x of it is below 4 MiB
    assert backend.asked == [4 * MiB]        # 0.9x would be below the request: not even asked
    assert (list(alloc.chunks()), alloc.memory_stats(), alloc.curr_region_bytes) == before


def test_growth_never_passes_the_fraction_cap():
    backend = RecordingBackend(1 << 30)
    alloc = BFCAllocator(backend, 10 * MiB, preallocate=False)
    live = []
    with pytest.raises(OutOfMemory) as info:
        while True:
            live.append(alloc.allocate(MiB))
    assert backend.asked == [2 * MiB, 4 * MiB, 4 * MiB]     # the third is cut to what is left
    assert alloc.memory_stats()["pool_bytes"] == 10 * MiB == info.value.pool_bytes
    assert len(live) == 10


def test_adjacent_growth_regions_merge_and_chunks_merge_across_the_seam():
    alloc = pool(512 * MiB, preallocate=False)
    a = alloc.allocate(2 * MiB)              # fills the 2 MiB region exactly
    b = alloc.allocate(MiB)                  # 4 MiB region, right after it
    assert alloc.regions() == [(0, 6 * MiB)]
    alloc.free(a)
    alloc.free(b)                            # one free chunk over both regions
    assert [(c.address, c.size, c.in_use) for c in alloc.chunks()] == [(0, 6 * MiB, False)]
    assert alloc.allocate(5 * MiB).address == 0


def test_empty_cache_returns_wholly_free_regions_only():
    backend = SimulatedBackend(1 << 30)
    alloc = BFCAllocator(backend, 512 * MiB, preallocate=False)
    a = alloc.allocate(2 * MiB)              # region [0, 2 MiB)
    wall = backend.reserve(256)              # someone else takes the next bytes: no merge
    b = alloc.allocate(MiB)                  # region of 4 MiB further up
    assert len(alloc.regions()) == 2
    alloc.free(b)
    assert alloc.empty_cache() == 4 * MiB
    assert alloc.regions() == [(0, 2 * MiB)] and alloc.memory_stats()["pool_bytes"] == 2 * MiB
    assert alloc.empty_cache() == 0          # the other region is in use
    alloc.free(a)
    assert alloc.empty_cache() == 2 * MiB and backend.reserved == 256 and wall == 2 * MiB


def test_preallocated_pool_keeps_its_region_on_empty_cache():
    alloc = pool(64 * MiB)
    alloc.free(alloc.allocate(MiB))
    assert alloc.empty_cache() == 0 and alloc.memory_stats()["pool_bytes"] == 64 * MiB


# ---- out of memory ------------------------------------------------------------------------
def test_fragmentation_oom_says_so_and_shows_the_pool():
    alloc = pool(16 * MiB)
    live = [alloc.allocate(MiB) for _ in range(16)]
    for buf in live[::2]:
        alloc.free(buf)
    with pytest.raises(OutOfMemory) as info:
        alloc.allocate(2 * MiB)
    err = info.value
    assert err.fragmentation and "fragmentation" in str(err)
    assert err.largest_free_block == MiB and err.in_use == 8 * MiB and err.pool_bytes == 16 * MiB
    assert occupancy(err.chunks, 16) == "_*" * 8        # one cell per MiB: every other one used
    total = 16 * MiB
    cells = [(Fraction(c * total, 100), Fraction((c + 1) * total, 100)) for c in range(100)]
    used = [sum(max(0, min(hi, b.address + b.size) - max(lo, b.address)) for b in live[1::2])
            for lo, hi in cells]
    assert err.occupancy == "".join("*" if 2 * u >= hi - lo else "_" for u, (lo, hi) in zip(used, cells))
    row = err.bins[bin_for_size(MiB)]
    assert (row["chunks"], row["chunks_in_use"], row["free_chunks"]) == (16, 8, 8)
    assert "Bin (1.00 MiB): 16 chunks, 8 in use" in err.dump()


def test_plain_oom_does_not_blame_fragmentation():
    alloc = pool(16 * MiB)
    alloc.allocate(10 * MiB)
    with pytest.raises(OutOfMemory) as info:
        alloc.allocate(8 * MiB)
    assert not info.value.fragmentation and "fragmentation" not in str(info.value)
    assert str(8 * MiB) in str(info.value) and "16.00 MiB" in str(info.value)


# ---- brute force ---------------------------------------------------------------------------
class ReferenceBFC:
    """The BFC policy written as plainly as possible: a list of [address, size, used] chunks per
    region, linear scans, no bins; and a list-scanning first-fit device. Slow and obvious."""

    def __init__(self, capacity, limit, preallocate):
        self.gaps = [[0, capacity]]          # device free ranges
        self.chunks = []                     # [address, size, used], address order
        self.limit, self.pool = limit, 0
        self.region = (limit + 255) // 256 * 256 if preallocate else min(limit, 2 * MiB)
        if preallocate:
            assert self.extend(256)

    def device_take(self, size):
        for gap in self.gaps:
            if gap[1] - gap[0] >= size:
                gap[0] += size
                return gap[0] - size
        return None

    def extend(self, rounded):
        available = (self.limit - self.pool) // 256 * 256
        if rounded > available:
            return False
        region, grew = self.region, False
        while rounded > region:
            region, grew = region * 2, True
        size = min(region, available)
        address = self.device_take(size)
        while address is None:
            size = (int(size * 0.9) + 255) // 256 * 256
            if size < rounded:
                return False
            address = self.device_take(size)
        self.region = region if grew else region * 2
        self.pool += size
        self.chunks.append([address, size, False])
        self.chunks.sort()
        self.merge()
        return True

    def merge(self):
        i = 0
        while i + 1 < len(self.chunks):
            a, b = self.chunks[i], self.chunks[i + 1]
            if not a[2] and not b[2] and a[0] + a[1] == b[0]:
                a[1] += b[1]
                del self.chunks[i + 1]
            else:
                i += 1

    def allocate(self, size):
        rounded = (size + 255) // 256 * 256
        fits = [c for c in self.chunks if not c[2] and c[1] >= rounded]
        if not fits:
            if not self.extend(rounded):
                return None
            fits = [c for c in self.chunks if not c[2] and c[1] >= rounded]
        chunk = min(fits, key=lambda c: (c[1], c[0]))
        if chunk[1] >= 2 * rounded or chunk[1] - rounded >= 128 * MiB:
            index = self.chunks.index(chunk)
            self.chunks.insert(index + 1, [chunk[0] + rounded, chunk[1] - rounded, False])
            chunk[1] = rounded
        chunk[2] = True
        return chunk[0], chunk[1]

    def free(self, address):
        for chunk in self.chunks:
            if chunk[0] == address:
                chunk[2] = False
        self.merge()


# exact powers of two hit the split rule's edge (chunk == 2 x request) often
SIZES = st.one_of(st.integers(1, 12 * MiB), st.sampled_from([256, 512, 768, 1024, MiB, 2 * MiB, 3 * MiB, 4 * MiB]))


@settings(max_examples=120, deadline=None)
@given(preallocate=st.booleans(), limit_mib=st.integers(4, 64),
       ops=st.lists(st.tuples(st.booleans(), SIZES, st.integers(0, 999)), max_size=60))
def test_matches_brute_force_reference(preallocate, limit_mib, ops):
    capacity, limit = 96 * MiB, limit_mib * MiB
    alloc = BFCAllocator(SimulatedBackend(capacity), limit, preallocate=preallocate)
    ref = ReferenceBFC(capacity, limit, preallocate)
    live = []
    for is_alloc, size, pick in ops:
        if is_alloc or not live:
            expected = ref.allocate(size)
            try:
                buf = alloc.allocate(size)
            except OutOfMemory:
                assert expected is None
                continue
            assert (buf.address, buf.size) == expected
            live.append(buf)
        else:
            buf = live.pop(pick % len(live))
            alloc.free(buf)
            ref.free(buf.address)
        got = [(c.address, c.size, c.in_use) for c in alloc.chunks()]
        assert got == [tuple(c) for c in ref.chunks]
        assert alloc.memory_stats()["pool_bytes"] == ref.pool


def test_oom_dump_shows_the_pool_at_the_failure_even_after_it_changes():
    alloc = pool(16 * MiB)
    live = [alloc.allocate(MiB) for _ in range(16)]
    for buf in live[::2]:
        alloc.free(buf)
    with pytest.raises(OutOfMemory) as info:
        alloc.allocate(2 * MiB)
    at_failure = list(alloc.chunks())
    for buf in live[1::2]:                   # the pool changes completely afterwards
        alloc.free(buf)
    alloc.allocate(10 * MiB)
    err = info.value
    assert err.chunks == at_failure
    assert occupancy(err.chunks, 16) == "_*" * 8
    assert err.bins[bin_for_size(MiB)]["chunks"] == 16


def test_a_dropped_oom_costs_no_copy_of_the_pool():
    alloc = pool(16 * MiB)
    keep = alloc.allocate(MiB)
    try:
        alloc.allocate(32 * MiB)
    except OutOfMemory:
        pass
    # nothing holds the error any more, so the pool has nothing to freeze for it
    assert alloc._oom.pending is not None and alloc._oom.pending() is None
    alloc.free(keep)
    assert alloc._oom.pending is None


def test_oom_names_a_device_that_cannot_supply_a_region():
    backend = RecordingBackend(1 << 30, refuse_above=3 * MiB)
    alloc = BFCAllocator(backend, 512 * MiB, preallocate=False)
    with pytest.raises(OutOfMemory, match="device could not supply a new region"):
        alloc.allocate(4 * MiB)
