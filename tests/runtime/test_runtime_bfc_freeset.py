"""The BFC pool's free set changes layout with its size (one flat sorted list up to 512 keys,
sublists past that, flat again at one sublist): across those changes every allocation must
still be the best fit that a brute-force search over the chunk walk finds, and the largest
free block must be the walk's."""

from __future__ import annotations

import random

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
    assert pool._flat is not None
    assert [(c.size, c.in_use) for c in pool.chunks()] == [(512 << 20, False)]


def test_best_fit_holds_when_runs_of_merging_frees_are_sorted_in_late():
    """With the free set in sublists, frees only note their keys (merged-away ones too) and the
    next allocation sorts them in, one by one after a short run, afresh after a long one: every
    allocation must still find what brute force finds, whatever the run length."""
    rng = random.Random(11)
    pool = BFCAllocator(SimulatedBackend(1 << 30), 512 << 20)
    live = [pool.allocate(rng.randint(1, 32 << 10)) for _ in range(4000)]
    for buf in live[::2]:
        pool.free(buf)
    live = live[1::2]
    calls = {"edits": 0, "rebuilds": 0}
    sort_in = pool._sort_in

    def counted_sort_in():
        rebuild = len(pool._pending) + len(pool._stale) > len(pool._free_start) // 8 + 32
        calls["rebuilds" if rebuild else "edits"] += 1
        sort_in()

    pool._sort_in = counted_sort_in
    for _ in range(300):
        rng.shuffle(live)
        for _ in range(rng.choice([1, 2, 5, 20, 150])):   # frees that merge with holes
            pool.free(live.pop())
        size = rng.randint(1, 64 << 10)
        expected = _brute_best_fit(pool, (size + 255) & -256)
        buf = pool.allocate(size)
        assert buf.address == expected
        live.append(buf)
        if len(live) < 200:
            break
    assert pool.memory_stats()["largest_free_block_bytes"] == _largest_free(pool)
    assert calls["edits"] > 10 and calls["rebuilds"] > 3
    for buf in live:
        pool.free(buf)
    assert [(c.size, c.in_use) for c in pool.chunks()] == [(512 << 20, False)]
    assert pool.memory_stats()["largest_free_block_bytes"] == 512 << 20
