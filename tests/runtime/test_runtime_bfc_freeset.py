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
