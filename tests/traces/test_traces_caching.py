"""PyTorch caching-allocator model: its documented rules, and invariants checked on every step.

The rule tests take their expected numbers from the constants and comments of PyTorch's
CUDACachingAllocator.cpp / AllocatorConfig.cpp (kMinBlockSize 512, kSmallSize 1 MiB, kSmallBuffer
2 MiB, kLargeBuffer 20 MiB, kMinLargeAlloc 10 MiB, kRoundLarge 2 MiB; "1200 with 4 divisions
rounds to 1280"). The hypothesis test drives random streams of allocations, frees and
empty_cache through every configuration and re-derives the whole state after each step.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxmem.errors import AllocationError, ConfigError, OutOfMemory
from jaxmem.runtime.backends import SimulatedBackend
from jaxmem.runtime.caching import _MASK, _SHIFT, LARGE, SMALL, CachingAllocator, make_caching_allocator
from jaxmem.runtime.caching_config import (
    NO_LIMIT, CachingConfig, config_from_settings, parse_alloc_conf, round_size,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def make(conf: str = "", capacity: int = 8 * GiB, expandable: bool = False) -> CachingAllocator:
    # an ample address space, the limit as the memory: a cudaMalloc fails only when bytes run out
    return make_caching_allocator(SimulatedBackend(max(capacity, 64 * GiB)), limit=capacity,
                                  expandable=expandable, alloc_conf=conf)


# ---- rules ------------------------------------------------------------------------------------
def test_rounding_to_512_and_power2_divisions() -> None:
    d = CachingConfig()
    assert [round_size(n, d) for n in (1, 511, 512, 513, 1025)] == [512, 512, 512, 1024, 1536]
    four = parse_alloc_conf("roundup_power2_divisions:4")
    assert round_size(1200, four) == 1536        # below 512*4 bytes: plain 512 rounding
    assert round_size(1200 * KiB, four) == 1280 * KiB   # PyTorch's own example, in KiB
    assert round_size(1 << 30, four) == 1 << 30  # powers of two stay
    per_interval = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert per_interval.roundup_power2_divisions[:8] == [1] * 8
    # AllocatorConfig.cpp fills ">" from the last listed interval itself onward, so the
    # 512 MiB interval ends up with 8, not 2: the model keeps that quirk
    assert per_interval.roundup_power2_divisions[8] == 1
    assert per_interval.roundup_power2_divisions[9:] == [8] * 7


@pytest.mark.parametrize("request_size, segment", [
    (1, 2 * MiB), (1 * MiB, 2 * MiB), (1 * MiB + 1, 20 * MiB), (10 * MiB - 512, 20 * MiB), (10 * MiB - 511, 10 * MiB),
    (10 * MiB, 10 * MiB), (11 * MiB, 12 * MiB), (101 * MiB + 5, 102 * MiB),
])
def test_segment_sizes(request_size: int, segment: int) -> None:
    alloc = make()
    alloc.allocate(request_size)
    assert (alloc.device_allocs, alloc.device_alloc_bytes) == (1, segment)


def test_small_and_large_pools_never_share() -> None:
    alloc = make()
    alloc.allocate(3 * MiB)          # large segment of 20 MiB, 17 MiB free in it
    alloc.allocate(4 * KiB)          # must not go into the large segment's free tail
    assert alloc.device_allocs == 2
    pools = {s["pool"]: s["size"] for s in alloc.segments()}
    assert pools == {"large": 20 * MiB, "small": 2 * MiB}


def test_split_rules_large_remainder_over_1mib_only() -> None:
    alloc = make()
    a = alloc.allocate(19 * MiB + 512)     # 20 MiB segment, 511.5 KiB left: not split
    assert a.size == 20 * MiB
    b = alloc.allocate(5 * MiB)            # new 20 MiB segment, 15 MiB left: split off
    assert b.size == 5 * MiB and alloc.device_allocs == 2
    c = alloc.allocate(3 * MiB // 2)       # large pool, served from the 15 MiB tail
    assert alloc.device_allocs == 2 and c.address == b.address + 5 * MiB
    d = alloc.allocate(13 * MiB)           # 13.5 MiB left, 0.5 MiB would remain: whole block
    assert d.size == 27 * MiB // 2 and alloc.device_allocs == 2


def test_best_fit_by_size_then_address() -> None:
    alloc = make()
    bufs = [alloc.allocate(n) for n in (12 * MiB, 14 * MiB, 12 * MiB)]
    for b in bufs:
        alloc.free(b)
    again = alloc.allocate(12 * MiB)
    assert again.address == min(bufs[0].address, bufs[2].address)
    assert alloc.allocate(13 * MiB).address == bufs[1].address   # the only block that fits
    assert alloc.device_allocs == 3


def test_streams_do_not_share_cached_blocks() -> None:
    alloc = make()
    alloc.free(alloc.allocate(4 * KiB, stream=1))
    alloc.allocate(4 * KiB, stream=2)
    assert alloc.device_allocs == 2
    alloc.allocate(4 * KiB, stream=1)
    assert alloc.device_allocs == 2


def test_max_split_size_rules() -> None:
    alloc = make("max_split_size_mb:40")
    big = alloc.allocate(100 * MiB)
    alloc.free(big)
    small = alloc.allocate(30 * MiB)       # may not take the oversize cached block
    assert alloc.device_allocs == 2 and small.address != big.address
    alloc.free(small)
    near = alloc.allocate(85 * MiB)        # within 20 MiB of the 100 MiB block: takes it whole
    assert near.address == big.address and near.size == 100 * MiB and alloc.device_allocs == 2
    alloc.free(near)
    far = alloc.allocate(60 * MiB)         # 100 >= 60 + 20: not allowed
    assert far.address != big.address and alloc.device_allocs == 3


def test_oom_retry_frees_cached_blocks_then_succeeds() -> None:
    alloc = make(capacity=100 * MiB)
    a = alloc.allocate(60 * MiB)
    alloc.free(a)                          # 60 MiB cached
    b = alloc.allocate(70 * MiB)           # cudaMalloc fails, release_cached_blocks, retry
    assert b.size == 70 * MiB and alloc.device_frees == 1 and alloc.num_alloc_retries == 1
    with pytest.raises(OutOfMemory) as info:
        alloc.allocate(40 * MiB)
    assert info.value.requested == 40 * MiB and info.value.in_use == 70 * MiB


def test_oversize_release_before_release_all() -> None:
    alloc = make("max_split_size_mb:20", capacity=200 * MiB)
    bufs = [alloc.allocate(n) for n in (50 * MiB, 60 * MiB, 30 * MiB)]
    for b in bufs:
        alloc.free(b)
    alloc.allocate(70 * MiB)               # free oversize blocks, largest first, until 70 MiB freed
    assert alloc.device_frees == 2 and alloc.memory_stats()["pool_bytes"] == 30 * MiB + 70 * MiB


def test_empty_cache_returns_only_whole_segments() -> None:
    alloc = make()
    keep = alloc.allocate(3 * MiB)
    alloc.free(alloc.allocate(30 * MiB))   # its own 30 MiB segment, whole once freed
    alloc.free(alloc.allocate(4 * KiB))
    alloc.free(alloc.allocate(12 * MiB))   # best fit: the 17 MiB tail of the first segment
    assert alloc.empty_cache() == 30 * MiB + 2 * MiB
    assert [s["size"] for s in alloc.segments()] == [20 * MiB] and keep.live


def test_garbage_collection_frees_the_oldest_cached_blocks_first() -> None:
    alloc = make("garbage_collection_threshold:0.7", capacity=100 * MiB)   # GC above 70 MiB reserved
    a, b = alloc.allocate(14 * MiB), alloc.allocate(30 * MiB)
    alloc.free(a)
    alloc.free(b)
    for _ in range(5):
        alloc.free(alloc.allocate(30 * MiB))   # reuses b: b stays young, a ages
    alloc.allocate(32 * MiB)                  # misses the cache; 44 MiB reserved <= 70: no GC
    assert alloc.device_frees == 0
    alloc.allocate(33 * MiB)                  # misses; 76 > 70: GC frees the oldest (a) and stops
    assert alloc.device_frees == 1
    assert sorted(s["size"] for s in alloc.segments()) == [30 * MiB, 32 * MiB, 34 * MiB]   # 33 MiB rounds to 2 MiB


def test_expandable_segments_map_pages_at_lowest_address() -> None:
    alloc = make(expandable=True)
    a = alloc.allocate(3 * MiB)
    assert (alloc.device_allocs, alloc.device_alloc_bytes) == (1, 20 * MiB)   # one 20 MiB page
    b = alloc.allocate(30 * MiB)
    assert b.address == a.address + 3 * MiB                  # same range, right after a
    assert alloc.memory_stats()["pool_bytes"] == 40 * MiB
    s = alloc.allocate(100)
    assert alloc.device_alloc_bytes == 42 * MiB and s.size == 512       # small pool: 2 MiB pages
    alloc.free(a)
    alloc.free(b)
    assert alloc.empty_cache() == 40 * MiB
    assert alloc.memory_stats()["pool_bytes"] == 2 * MiB


def test_settings_and_conf_parsing() -> None:
    cfg = config_from_settings({"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
                                "expandable_segments": False,
                                "roundup_power2_divisions": {"1": 0, "2": 4, "4": 0}})
    assert cfg.max_split_size == NO_LIMIT and cfg.roundup_power2_divisions[1] == 4
    assert parse_alloc_conf("max_split_size_mb:256, garbage_collection_threshold:0.6").max_split_size == 256 * MiB
    for bad in ("max_split_size_mb:10", "garbage_collection_threshold:1.5", "expandable_segments:yes",
                "roundup_power2_divisions:3", "bogus:1", "max_split_size_mb", "roundup_power2_divisions:[1:2"):
        with pytest.raises(ConfigError):
            parse_alloc_conf(bad)


def test_alignment_beyond_512_is_honoured_and_the_front_is_cached() -> None:
    alloc = make()
    live = [alloc.allocate(300)]
    for alignment in (1024, 4096, 1 << 20):
        for size in (1, 5000, 3 * MiB):
            buf = alloc.allocate(size, alignment=alignment)
            assert buf.address % alignment == 0 and buf.size >= size
            live.append(buf)
            check(alloc, live, aligned=True)
    for b in live:
        alloc.free(b)
    check(alloc, [], aligned=True)
    with pytest.raises(AllocationError):
        alloc.allocate(100, alignment=3000)


# ---- invariants on every step ---------------------------------------------------------------------
def check(alloc: CachingAllocator, live: list, aligned: bool = False) -> None:
    segs = alloc.segments()
    objs = {b.addr: b for seg in alloc._segments.values() for b in seg.blocks()}
    end = -1
    allocated = {}
    mapped_total = 0
    for s in segs:
        assert s["addr"] >= end, "segments overlap"
        end = s["addr"] + s["size"]
        blocks = s["blocks"]
        assert blocks[0]["addr"] == s["addr"]
        for x, y in zip(blocks, blocks[1:]):
            assert x["addr"] + x["size"] == y["addr"], "blocks do not tile the segment"
            assert x["allocated"] or y["allocated"] or x["mapped"] != y["mapped"], "free neighbours not merged"
        assert blocks[-1]["addr"] + blocks[-1]["size"] == end
        for b in blocks:
            blk = objs[b["addr"]]
            assert blk.seg.addr == s["addr"] and blk.pool == (SMALL if s["pool"] == "small" else LARGE)
            if b["mapped"]:
                mapped_total += b["size"]
            if b["allocated"]:
                allocated[b["addr"]] = b["size"]
            elif b["mapped"]:
                key = (b["size"] << _SHIFT) | b["addr"]
                assert key in alloc._freelists[blk.pool][blk.stream] and alloc._free_block[b["addr"]] is blk
                if s["pool"] == "large" and not s["expandable"] and not aligned:
                    assert b["size"] > MiB, "a free large-pool block of 1 MiB or less"
            else:
                assert alloc._unmapped_block[b["addr"]] is blk
        if not s["expandable"]:
            assert s["size"] == 2 * MiB if s["pool"] == "small" else s["size"] > MiB
    n_free = sum(len(keys) for pool in alloc._freelists for keys in pool.values())
    assert n_free == len(alloc._free_block)
    for pool in alloc._freelists:
        for keys in pool.values():
            assert keys == sorted(keys)
            for key in keys:
                assert alloc._free_block[key & _MASK].size == key >> _SHIFT
    assert allocated == {b.address: b.size for b in live}
    assert alloc.bytes_in_use == sum(allocated.values())
    assert alloc.reserved_bytes == mapped_total == alloc.backend.reserved
    assert alloc.reserved_bytes <= alloc.limit
    for b in live if not aligned else ():
        rounded = round_size(b.requested_size, alloc.config)
        assert b.size >= rounded and b.address % 512 == 0
        slack = MiB if rounded > MiB and not alloc.config.expandable_segments else 511
        assert b.size - rounded <= slack or b.size >= alloc.config.max_split_size


def brute_force_best_fit(alloc: CachingAllocator, request: int, stream: int) -> int | None:
    """The address PyTorch's rules pick among the cached blocks, found by scanning every block of
    every segment (not the allocator's free lists); None when no cached block may serve."""
    rounded = round_size(request, alloc.config)
    pool = "small" if rounded <= MiB else "large"
    free = sorted((b["size"], b["addr"]) for s in alloc.segments() if s["pool"] == pool and s["stream"] == stream
                  for b in s["blocks"] if not b["allocated"] and b["mapped"] and b["size"] >= rounded)
    if not free:
        return None
    size, addr = free[0]
    mss = alloc.config.max_split_size
    if rounded < mss <= size or (rounded >= mss and size >= rounded + alloc.config.max_non_split_rounding_size):
        return None
    return addr


SIZES = st.one_of(st.integers(1, 1 * MiB), st.integers(1 * MiB + 1, 10 * MiB), st.integers(10 * MiB, 120 * MiB))
OPS = st.lists(st.one_of(
    st.tuples(st.just("alloc"), SIZES, st.sampled_from([0, 0, 7])),
    st.tuples(st.just("free"), st.integers(0, 1 << 30), st.just(0)),
    st.tuples(st.just("empty"), st.just(0), st.just(0)),
), min_size=1, max_size=60)
CONFS = ["", "max_split_size_mb:40", "roundup_power2_divisions:4", "roundup_power2_divisions:[1:2,16:8,>:1]",
         "garbage_collection_threshold:0.4", "max_split_size_mb:20,garbage_collection_threshold:0.7"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, conf=st.sampled_from(CONFS), expandable=st.booleans(), capacity=st.sampled_from([300 * MiB, 2 * GiB]))
def test_invariants_hold_after_every_step(ops, conf, expandable, capacity) -> None:
    alloc = make(conf, capacity=capacity, expandable=expandable)
    live: list = []
    for op, arg, stream in ops:
        if op == "alloc":
            before = alloc.bytes_in_use
            expected = None if expandable else brute_force_best_fit(alloc, arg, stream)
            device_allocs = alloc.device_allocs
            try:
                live.append(alloc.allocate(arg, stream=stream))
            except OutOfMemory as err:
                assert alloc.bytes_in_use == before and err.requested == arg
                assert expected is None
            else:
                if expected is not None:   # a cached block fits: best fit by (size, address), no cudaMalloc
                    assert live[-1].address == expected and alloc.device_allocs == device_allocs
        elif op == "free" and live:
            alloc.free(live.pop(arg % len(live)))
        elif op == "empty":
            alloc.empty_cache()
            assert all(not (b["allocated"] is False and len(s["blocks"]) == 1 and not s["expandable"])
                       for s in alloc.segments() for b in s["blocks"]), "a whole free segment survived empty_cache"
        check(alloc, live)
    for b in live:
        alloc.free(b)
    check(alloc, [])
    alloc.empty_cache()
    assert alloc.reserved_bytes == 0 and alloc.segments() == []
