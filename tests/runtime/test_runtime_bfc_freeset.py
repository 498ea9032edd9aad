"""The BFC pool's free set changes layout with its size (one flat sorted list up to 512 keys,
sublists past that, flat again at one sublist): across those changes every allocation must
still be the best fit that a brute-force search over the chunk walk finds, and the largest
free block must be the walk's."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxmem.runtime.backends import SimulatedBackend
from jaxmem.runtime.bfc import BFCAllocator


def _brute_best_fit(pool: BFCAllocator, rounded: int) -> int | None:
    """The address XLA's BFC picks: the smallest free chunk that fits, the lowest address among equals."""
    fits = [(c.size, c.address) for c in pool.chunks() if not c.in_use and c.size >= rounded]
    return min(fits)[1] if fits else None


def _largest_free(pool: BFCAllocator) -> int:
    return max((c.size for c in pool.chunks() if not c.in_use), default=0)


def test_best_fit_holds_while_the_free_set_grows_past_512_and_shrinks_back():
    rng = random.Random(7)
    pool = BFCAllocator(SimulatedBackend(1 << 30), 512 << 20)
    live = [pool.allocate(rng.randint(1, 64 << 10)) for _ in range(3000)]
    holes = live[::2]                   # freeing every other buffer leaves 1,500 separate holes
    kept = live[1::2]
    for step, buf in enumerate(holes):
        pool.free(buf)
        if step % 97 == 0:
            assert pool.memory_stats()["largest_free_block_bytes"] == _largest_free(pool)
    assert pool._flat is None and len(pool._lists) > 2     # the free set is in sublists now
    for _ in range(400):                # allocations that reuse holes, checked against brute force
        size = rng.randint(1, 64 << 10)
        expected = _brute_best_fit(pool, (size + 255) & -256)
        buf = pool.allocate(size)
        assert buf.address == expected
        kept.append(buf)
    rng.shuffle(kept)
    for step, buf in enumerate(kept):   # merging shrinks the free set back to one chunk
        pool.free(buf)
        if step % 53 == 0:
            assert pool.memory_stats()["largest_free_block_bytes"] == _largest_free(pool)
            size = rng.randint(1, 64 << 10)
            expected = _brute_best_fit(pool, (size + 255) & -256)
            probe = pool.allocate(size)
            assert probe.address == expected
            pool.free(probe)
    assert [(c.size, c.in_use) for c in pool.chunks()] == [(512 << 20, False)]
    assert pool._flat is not None       # read once, the set has merged its notes and gone flat


def test_best_fit_holds_when_runs_of_frees_are_merged_in_late():
    """With the free set in sublists, a free only notes its chunk and the next allocation
    merges the notes in, one by one after a short run, by a rebuild after a long one: every
    allocation must be what brute force finds on a twin pool given the same calls (the pool
    under test is never read between its frees and its allocation)."""
    rng = random.Random(11)
    pool, twin = (BFCAllocator(SimulatedBackend(1 << 30), 512 << 20) for _ in range(2))
    sizes = [rng.randint(1, 32 << 10) for _ in range(6000)]
    live = [(pool.allocate(n), twin.allocate(n)) for n in sizes]
    for a, b in live[::2]:
        pool.free(a)
        twin.free(b)
    live = live[1::2]
    calls = {"one by one": 0, "rebuilds": 0}
    merge_freed = pool._merge_freed

    def counted_merge_freed():
        rebuild = len(pool._freed) // 2 > len(pool._free_start) // 4 + 32
        calls["rebuilds" if rebuild else "one by one"] += 1
        merge_freed()

    pool._merge_freed = counted_merge_freed
    while len(live) > 1000:
        rng.shuffle(live)
        for _ in range(rng.choice([1, 2, 5, 20, 150, 900])):   # frees, many next to holes
            a, b = live.pop()
            pool.free(a)
            twin.free(b)
        size = rng.randint(1, 64 << 10)
        expected = _brute_best_fit(twin, (size + 255) & -256)
        a, b = pool.allocate(size), twin.allocate(size)
        assert a.address == b.address == expected
        live.append((a, b))
    assert calls["one by one"] > 10 and calls["rebuilds"] >= 2
    assert list(pool.chunks()) == list(twin.chunks())
    assert pool.memory_stats()["largest_free_block_bytes"] == _largest_free(pool)
    for a, b in live:
        pool.free(a)
    assert [(c.size, c.in_use) for c in pool.chunks()] == [(512 << 20, False)]
    assert pool.memory_stats()["largest_free_block_bytes"] == 512 << 20


def test_a_drained_pool_is_whole_again_in_growth_mode_across_regions():
    """Frees noted in a large free set are merged at the next read, across the seams of
    regions that the device placed side by side, and empty_cache then returns every region."""
    rng = random.Random(5)
    backend = SimulatedBackend(1 << 30)
    pool = BFCAllocator(backend, 768 << 20, preallocate=False)
    live = [pool.allocate(rng.randint(1, 256 << 10)) for _ in range(3000)]
    assert len(pool.regions()) >= 1 and pool.memory_stats()["pool_bytes"] > 2 << 20
    rng.shuffle(live)
    for buf in live:
        pool.free(buf)
    chunks = list(pool.chunks())
    assert all(not c.in_use for c in chunks)
    assert len(chunks) == len(pool.regions())          # one free chunk per region
    held = sum(end - start for start, end in pool.regions())
    assert held == pool.memory_stats()["pool_bytes"] > 0
    assert pool.empty_cache() == held
    assert pool.regions() == []
    assert backend.reserved == 0 and pool.memory_stats()["pool_bytes"] == 0


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), preallocate=st.booleans())
def test_a_pool_never_read_places_every_buffer_as_one_read_after_every_step(seed, preallocate):
    """Random bursts (thousands of buffers, hundreds to over a thousand free chunks): a pool
    that merges its frees only when it must, at its next allocation, one by one or by a rebuild,
    against a twin whose statistics are read after every call, so that it merges at once.
    Every allocation, and the chunks at the end, must agree."""
    rng = random.Random(seed)
    lazy, eager = (BFCAllocator(SimulatedBackend(2 << 30), 1 << 30, preallocate=preallocate) for _ in range(2))
    live: list = []

    def free_one(index: int) -> None:
        a, b = live.pop(index)
        lazy.free(a)
        eager.free(b)
        eager.memory_stats()

    for _ in range(30):
        if live and rng.random() < 0.5:            # a run of frees: a share of what is live
            rng.shuffle(live)
            for _ in range(int(len(live) * rng.uniform(0.05, 0.7))):
                free_one(-1)
        else:                                      # allocations, with a free now and then
            for _ in range(rng.randint(1, 1500)):
                if live and rng.random() < 0.3:
                    free_one(rng.randrange(len(live)))
                size = rng.randint(1, 64 << 10)
                a, b = lazy.allocate(size), eager.allocate(size)
                eager.memory_stats()
                assert (a.address, a.size) == (b.address, b.size)
                live.append((a, b))
    assert list(lazy.chunks()) == list(eager.chunks())
    assert lazy.memory_stats() == eager.memory_stats()
