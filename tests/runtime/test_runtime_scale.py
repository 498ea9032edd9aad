"""RMM's random_allocations workload at benchmark scale, with the invariants checked as it runs."""

from __future__ import annotations

import random

import pytest
from runtime_checks import FACTORIES, check_invariants, check_regions

from jaxmem.errors import OutOfMemory
from jaxmem.units import GiB, MiB


def _workload(alloc, count, max_size, seed, check_every):
    rng = random.Random(seed)
    budget = alloc.limit
    live, in_use, made, failed = [], 0, 0, 0
    for step in range(2 * count):
        size = rng.randint(1, max_size)
        if not live or (rng.random() < 0.73 and made < count and in_use + size < budget):
            try:
                buf = alloc.allocate(size)
            except OutOfMemory:
                failed += 1
            else:
                live.append(buf)
                made += 1
                in_use += buf.size
                continue
        if live:
            buf = live.pop(rng.randrange(len(live)))
            in_use -= buf.size
            alloc.free(buf)
        if step % check_every == 0:
            check_invariants(alloc, live)
    check_invariants(alloc, live)
    check_regions(alloc)
    for buf in live:
        alloc.free(buf)
    check_invariants(alloc, [])
    return made, failed


@pytest.mark.parametrize("name", ["bfc", "bfc-growth", "platform"])
@pytest.mark.parametrize("max_size", [MiB, 64 * MiB])
def test_random_allocations_keep_invariants(name, max_size):
    alloc = FACTORIES[name](8 * GiB, limit=6 * GiB)
    made, failed = _workload(alloc, 3000, max_size, seed=1, check_every=997)
    assert made > 2000


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bfc", "bfc-growth", "platform"])
@pytest.mark.parametrize("max_size", [MiB, 64 * MiB, GiB])
def test_random_allocations_at_benchmark_scale(name, max_size):
    alloc = FACTORIES[name](80 * GiB, limit=60 * GiB)
    made, failed = _workload(alloc, 100_000, max_size, seed=2, check_every=20_011)
    assert made > 50_000
