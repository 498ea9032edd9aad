"""The simulated driver: address-ordered first fit, checked against a brute-force model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxmem.errors import AllocationError, ConfigError
from jaxmem.runtime.backends import HostBackend, SimulatedBackend, make_backend


def brute_first_fit(taken: dict[int, int], capacity: int, size: int, alignment: int) -> int | None:
    """Lowest aligned address where [a, a+size) overlaps nothing taken: try every candidate."""
    candidates = sorted({0} | {a + s for a, s in taken.items()})
    for start in candidates:
        address = -(-start // alignment) * alignment
        if address + size > capacity:
            continue
        if all(address + size <= a or a + s <= address for a, s in taken.items()):
            return address
    return None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000), st.sampled_from([1, 256, 512, 4096]),
                          st.integers(0, 99)), max_size=50))
def test_first_fit_matches_brute_force(ops):
    capacity = 40_000
    backend = SimulatedBackend(capacity, address_space=capacity)   # gaps must be contiguous
    taken: dict[int, int] = {}
    for reserve, size, alignment, pick in ops:
        if reserve or not taken:
            expected = brute_first_fit(taken, capacity, size, max(alignment, 256))
            if sum(taken.values()) + size > capacity:
                expected = None
            got = backend.reserve(size, alignment)
            assert got == expected
            if got is not None:
                taken[got] = size
        else:
            address = sorted(taken)[pick % len(taken)]
            backend.release(address)
            del taken[address]
        assert backend.reserved == sum(taken.values()) and backend.allocations == taken


def test_regions_asked_one_after_another_are_adjacent():
    backend = SimulatedBackend("1GiB")
    a, b, c = backend.reserve(2 << 20), backend.reserve(4 << 20), backend.reserve(8 << 20)
    assert (a, b, c) == (0, 2 << 20, 6 << 20)
    backend.release(b)
    assert backend.reserve(1 << 20) == 2 << 20      # the lowest hole first


def test_simulated_device_refuses_only_when_bytes_run_out():
    """As with cudaMalloc, memory free between live allocations still serves a large request."""
    backend = SimulatedBackend(10 * 4096)
    blocks = [backend.reserve(4096) for _ in range(10)]
    for address in blocks[::2]:
        backend.release(address)
    big = backend.reserve(5 * 4096)            # no 20 KiB gap among the holes, but 20 KiB free
    assert big is not None and all(big >= a + 4096 or big + 5 * 4096 <= a for a in blocks[1::2])
    assert backend.reserve(1) is None          # every byte is in use now
    host = HostBackend(10 * 4096)
    blocks = [host.reserve(4096) for _ in range(10)]
    for address in blocks[::2]:
        host.release(address)
    assert host.reserve(2 * 4096) is None      # one real buffer: the gap must be contiguous


def test_capacity_is_a_hard_limit():
    backend = SimulatedBackend(4096)
    assert backend.reserve(4096) == 0 and backend.reserve(1) is None
    with pytest.raises(AllocationError, match="unknown address"):
        backend.release(123)
    with pytest.raises(AllocationError, match="positive"):
        backend.reserve(0)


def test_host_views_are_the_devices_bytes():
    backend = HostBackend("64KiB")
    a, b = backend.reserve(1000), backend.reserve(1000)
    backend.view(a, 1000)[:] = 1
    backend.view(b, 1000)[:] = 2
    assert np.all(backend.memory[a:a + 1000] == 1) and np.all(backend.memory[b:b + 1000] == 2)
    with pytest.raises(AllocationError, match="outside"):
        backend.view(64 * 1024 - 10, 20)


def test_make_backend_names():
    assert make_backend("host", 4096).kind == "host" and make_backend("simulated", "1TiB").kind == "simulated"
    with pytest.raises(ConfigError, match="unknown backend"):
        make_backend("cuda", 4096)
