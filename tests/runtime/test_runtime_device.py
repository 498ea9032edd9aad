"""Device: capacities, backends, views, and byte patterns that catch overlapping buffers."""

from __future__ import annotations

import random

import numpy as np
import pytest
from runtime_checks import check_invariants

from jaxmem.errors import AllocationError, ConfigError, OutOfMemory
from jaxmem.runtime.device import Device
from jaxmem.runtime.registry import ALLOCATOR_NAMES, make_allocator
from jaxmem.runtime.backends import SimulatedBackend
from jaxmem.units import GiB, MiB, PRESETS


@pytest.mark.parametrize("capacity,expected", [(1 << 30, 1 << 30), ("16GiB", 16 * GiB), ("80GB", 80 * 10**9),
                                               ("h100-80gb", PRESETS["h100-80gb"])])
def test_capacity_forms(capacity, expected):
    device = Device(capacity)
    assert device.capacity == expected
    assert device.memory_stats()["bytes_limit"] == int(expected * 0.75)


@pytest.mark.parametrize("kwargs,match", [
    (dict(capacity="lots"), "cannot read size"), (dict(capacity=0), "positive"),
    (dict(capacity="1GiB", backend="cuda"), "unknown backend"),
    (dict(capacity="1GiB", allocator="jemalloc"), "unknown allocator"),
    (dict(capacity="1GiB", mem_fraction=0), "above 0"),
    (dict(capacity="1GiB", mem_fraction=1.2), "TF_FORCE_UNIFIED_MEMORY"),
])
def test_bad_device_settings(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        Device(kwargs.pop("capacity"), **kwargs)


def test_unified_memory_fraction_above_one_backs_off_to_the_device():
    device = Device("1GiB", mem_fraction=1.5, unified_memory=True)
    stats = device.memory_stats()
    assert stats["bytes_limit"] == int(1.5 * GiB) and stats["pool_bytes"] <= GiB


def test_registry_lists_the_names():
    assert {"bfc", "bfc-growth", "platform", "caching", "caching-expandable"} <= set(ALLOCATOR_NAMES)
    growth = make_allocator("bfc-growth", SimulatedBackend("1GiB"), limit=GiB)
    assert not growth.preallocate and growth.memory_stats()["pool_bytes"] == 0


def test_simulated_device_has_no_bytes_to_view():
    device = Device("1GiB")
    with pytest.raises(AllocationError, match="backend='host'"):
        device.view(device.allocate(10))


def test_view_refuses_freed_and_foreign_buffers():
    device, other = Device("4MiB", backend="host"), Device("4MiB", backend="host")
    buf = device.allocate(10)
    with pytest.raises(AllocationError, match="does not belong"):
        other.view(buf)
    device.free(buf)
    with pytest.raises(AllocationError, match="freed"):
        device.view(buf)


@pytest.mark.parametrize("allocator,preallocate", [("bfc", True), ("bfc", False), ("platform", True)])
def test_host_byte_patterns_survive_until_free(allocator, preallocate):
    """Each live buffer holds its own pattern; if two ever overlapped, one would be overwritten."""
    device = Device("64MiB", backend="host", allocator=allocator, preallocate=preallocate)
    rng = random.Random(11)
    live: dict[int, tuple] = {}
    for step in range(600):
        if live and rng.random() < 0.45:
            key = rng.choice(list(live))
            buf, pattern = live.pop(key)
            assert np.array_equal(device.view(buf), pattern)
            device.free(buf)
        else:
            try:
                buf = device.allocate(rng.choice([rng.randint(1, 3000), rng.randint(1, 3 * MiB)]))
            except OutOfMemory:
                continue
            pattern = np.frombuffer(rng.randbytes(buf.requested_size), dtype=np.uint8)
            view = device.view(buf)
            assert view.shape == (buf.requested_size,) and view.dtype == np.uint8
            view[:] = pattern
            live[step] = (buf, pattern)
    for buf, pattern in live.values():
        assert np.array_equal(device.view(buf), pattern)
    check_invariants(device.allocator, [b for b, _ in live.values()])


def test_occupancy_map_and_chunks():
    device = Device("16MiB", mem_fraction=1.0)
    bufs = [device.allocate(MiB) for _ in range(16)]
    for buf in bufs[8:]:
        device.free(buf)
    assert device.occupancy_map(16) == "*" * 8 + "_" * 8
    assert len(list(device.chunks())) == 9
    assert "bfc" in repr(device)


def test_a_host_view_cannot_write_into_a_later_allocation():
    """After free, the views `view` gave are read-only; a view made from one before the free
    still writes, but into bytes held for it: no new allocation gets them while it lives."""
    device = Device("1MiB", backend="host", allocator="bfc", preallocate=True, mem_fraction=1.0)
    buf = device.allocate(4096)
    view = device.view(buf)
    typed = view.view(np.float32)[8:]
    address = buf.address
    device.free(buf)
    assert not buf.live
    with pytest.raises(ValueError, match="read-only"):
        view[:] = 1
    with pytest.raises(AllocationError, match="freed"):
        device.view(buf)
    with pytest.raises(AllocationError, match="double free"):
        device.free(buf)
    new = device.allocate(4096)
    assert new.address != address
    device.view(new)[:] = 7
    typed[:] = 1.0   # into the held bytes only
    assert np.all(device.view(new) == 7)
    assert device.memory_stats()["bytes_in_use"] == 2 * 4096
    del view, typed
    assert device.memory_stats()["bytes_in_use"] == 4096
    again = device.allocate(4096)
    assert again.address == address   # the bytes went back once the last view was gone
    device.view(again)[:] = 3
    assert np.all(device.view(new) == 7) and np.all(device.view(again) == 3)


def test_freeing_with_no_view_left_gives_the_bytes_back_at_once():
    device = Device("1MiB", backend="host", allocator="bfc", mem_fraction=1.0)
    buf = device.allocate(4096)
    device.view(buf)[:] = 5
    device.free(buf)
    assert device.memory_stats()["bytes_in_use"] == 0
    assert device.allocate(4096).address == buf.address
