"""Wrappers: a limit and a recorder stack on any allocator and keep its contract."""

from __future__ import annotations

import random

import numpy as np
import pytest
from runtime_checks import check_invariants

from jaxmem.errors import ConfigError, OutOfMemory
from jaxmem.runtime.adaptors import LimitingAdaptor, TrackingAdaptor, track
from jaxmem.runtime.backends import SimulatedBackend
from jaxmem.runtime.device import Device
from jaxmem.runtime.registry import make_allocator
from jaxmem.units import MiB


def test_limit_refuses_past_the_limit_and_changes_nothing():
    inner = make_allocator("platform", SimulatedBackend("1GiB"), limit=1 << 30)
    capped = LimitingAdaptor(inner, 10 * MiB)
    a = capped.allocate(6 * MiB)
    before = list(capped.chunks()), capped.memory_stats(), inner.memory_stats()
    with pytest.raises(OutOfMemory, match="limited to 10.00 MiB") as info:
        capped.allocate(5 * MiB)
    assert (list(capped.chunks()), capped.memory_stats(), inner.memory_stats()) == before
    assert info.value.in_use == 6 * MiB and len(info.value.chunks) == 1
    capped.free(a)
    capped.allocate(10 * MiB)                # exactly the limit fits
    with pytest.raises(ConfigError):
        LimitingAdaptor(inner, 0)


def test_limit_stacks_on_a_recorder():
    inner = make_allocator("bfc", SimulatedBackend("1GiB"), limit=64 * MiB)
    recorder = TrackingAdaptor(inner)
    capped = LimitingAdaptor(recorder, 4 * MiB)
    buf = capped.allocate(3 * MiB)
    with pytest.raises(OutOfMemory):
        capped.allocate(2 * MiB)             # refused by the limit: the recorder never saw it
    capped.free(buf)
    assert [e.action for e in recorder.events] == ["alloc", "free"]   # the region predates tracking
    assert [(s.addr, s.size) for s in recorder.trace().initial_segments] == [(0, 64 * MiB)]
    assert capped.memory_stats()["num_allocs"] == recorder.memory_stats()["num_allocs"] == inner.num_allocs == 1


def test_recorder_events_are_a_faithful_log():
    """The recorded events, read back alone, give the pool's own counters."""
    rng = random.Random(5)
    inner = make_allocator("bfc-growth", SimulatedBackend("1GiB"), limit=256 * MiB)
    recorder = TrackingAdaptor(inner)
    live, ooms = [], 0
    for _ in range(500):
        if live and rng.random() < 0.4:
            recorder.free(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(recorder.allocate(rng.randint(1, 40 * MiB)))
            except OutOfMemory:
                ooms += 1
        if rng.random() < 0.02:
            recorder.empty_cache()
    check_invariants(recorder, live)
    events = recorder.trace().events
    in_use = peak = reserved = 0
    addresses: dict[int, int] = {}
    for e in events:
        if e.action == "alloc":
            assert e.addr not in addresses
            addresses[e.addr] = e.size
            in_use += e.size
            peak = max(peak, in_use)
        elif e.action == "free":
            assert addresses.pop(e.addr) == e.size
            in_use -= e.size
        elif e.action == "segment_alloc":
            reserved += e.size
        elif e.action == "segment_free":
            reserved -= e.size
    stats = inner.memory_stats()
    assert in_use == stats["bytes_in_use"] and peak == stats["peak_bytes_in_use"]
    assert reserved == stats["pool_bytes"] == inner.backend.reserved
    assert sum(e.action == "oom" for e in events) == ooms
    assert sum(e.action == "segment_alloc" for e in events) == inner.device_allocs
    assert sorted(addresses) == sorted(b.address for b in live)


def test_track_wraps_a_device_in_place():
    device = Device("4MiB", backend="host", mem_fraction=1.0)
    recorder = track(device)
    buf = device.allocate(100)
    device.view(buf)[:] = np.arange(100, dtype=np.uint8)
    assert device.view(buf).sum() == sum(range(100))
    device.free(buf)
    trace = recorder.trace()
    assert [e.action for e in trace.events] == ["alloc", "free"]   # preallocated before tracking
    assert [(s.addr, s.size) for s in trace.initial_segments] == [(0, 4 * MiB)]
    assert trace.events[0].requested == 100 and trace.allocator_settings["capacity"] == 4 * MiB
