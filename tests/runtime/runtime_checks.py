"""Allocator factories the runtime tests run over, and independent checkers of pool invariants.

Adding an allocator to the conformance suite is one line in FACTORIES: a name and a function
(capacity, *, limit, backend_kind) -> Allocator.
"""

from __future__ import annotations

import pytest

from jaxmem.runtime.backends import make_backend
from jaxmem.runtime.registry import make_allocator


def _factory(name: str, **options):
    def make(capacity: int, *, limit: int | None = None, backend_kind: str = "simulated"):
        backend = make_backend(backend_kind, capacity)
        return make_allocator(name, backend, limit=capacity if limit is None else limit, **options)

    make.__name__ = name
    return make


def _wrapped(name: str, adaptor: str):
    def make(capacity: int, *, limit: int | None = None, backend_kind: str = "simulated"):
        from jaxmem.runtime.adaptors import LimitingAdaptor, TrackingAdaptor

        inner = _factory(name)(capacity, limit=limit, backend_kind=backend_kind)
        return LimitingAdaptor(inner, inner.limit) if adaptor == "limit" else TrackingAdaptor(inner)

    make.__name__ = f"{name}+{adaptor}"
    return make


FACTORIES = {
    "bfc": _factory("bfc"),
    "bfc-growth": _factory("bfc-growth"),
    "platform": _factory("platform"),
    "caching": _factory("caching"),
    # wrappers stack on any allocator and must keep the same contract
    "bfc+limit": _wrapped("bfc", "limit"),
    "bfc-growth+tracking": _wrapped("bfc-growth", "tracking"),
}

# Allocators that keep a pool of regions (not one allocation per buffer).
POOLED = {"bfc", "bfc-growth"}




def recompute_stats(allocator) -> dict[str, int]:
    """bytes_in_use, pool_bytes and largest free block, counted again from `chunks()`."""
    chunks = list(allocator.chunks())
    in_use = sum(c.size for c in chunks if c.in_use)
    pool = sum(c.size for c in chunks)
    largest = max((c.size for c in chunks if not c.in_use), default=0)
    return {"bytes_in_use": in_use, "pool_bytes": pool, "largest_free_block_bytes": largest}


def check_invariants(allocator, live: list) -> None:
    """Assert everything the pool promises, from scratch, against the caller's own list of buffers."""
    chunks = list(allocator.chunks())
    # Chunks tile their regions: address order, no overlap, no gap inside a region.
    for a, b in zip(chunks, chunks[1:]):
        assert a.address + a.size <= b.address, (a, b)
        if a.region == b.region:
            assert a.address + a.size == b.address, (a, b)
            # no two free neighbours left unmerged
            assert a.in_use or b.in_use, ("unmerged free neighbours", a, b)
    used = {c.address: c for c in chunks if c.in_use}
    # Every live buffer is exactly one chunk in use, and nothing else is in use.
    assert sorted(used) == sorted(b.address for b in live)
    for buf in live:
        chunk = used[buf.address]
        assert chunk.size == buf.size >= buf.requested_size
    # No two live buffers overlap (checked on the buffers themselves, not on the chunks).
    spans = sorted((b.address, b.address + b.size) for b in live)
    for (s0, e0), (s1, e1) in zip(spans, spans[1:]):
        assert e0 <= s1
    # Stats equal a recomputation.
    stats = allocator.memory_stats()
    again = recompute_stats(allocator)
    for key, value in again.items():
        assert stats[key] == value, (key, stats[key], value)
    assert stats["bytes_in_use"] == sum(b.size for b in live)
    assert stats["peak_bytes_in_use"] >= stats["bytes_in_use"]
    assert stats["pool_bytes"] <= stats["bytes_limit"]
    assert stats["peak_pool_bytes"] >= stats["pool_bytes"]
    free = stats["pool_bytes"] - stats["bytes_in_use"]
    expected = (free - stats["largest_free_block_bytes"]) / free if free else 0.0
    assert stats["fragmentation"] == pytest.approx(expected)
    # The backend holds exactly the pool's bytes.
    assert allocator.backend.reserved == stats["pool_bytes"]


def _merged(spans):
    out: list[list[int]] = []
    for start, end in sorted(spans):
        if out and out[-1][1] == start:
            out[-1][1] = end
        else:
            out.append([start, end])
    return out


def check_regions(allocator) -> None:
    """The pool's chunks cover exactly the memory the backend handed out: every chunk, so every
    live buffer, lies inside a device allocation, and no device allocation is lost."""
    chunk_spans = [(c.address, c.address + c.size) for c in allocator.chunks()]
    backend_spans = [(a, a + s) for a, s in allocator.backend.allocations.items()]
    assert _merged(chunk_spans) == _merged(backend_spans)
