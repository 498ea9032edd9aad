"""Wrappers that stack on any allocator: a byte limit, and a recorder of every event.

As in RMM, a limit or a log is not an option of one allocator but an allocator of its own
that forwards to the one it wraps, through that one's public allocate/free pair, so both keep
true statistics and any number of wrappers stack.

    device = Device("16GiB")
    recorder = track(device)                     # wrap device.allocator in place
    device.free(device.allocate(1 << 20))
    recorder.trace().events                      # [segment_alloc?, alloc, free] as jaxmem traces
    capped = LimitingAdaptor(make_allocator("platform", SimulatedBackend("16GiB"), limit=16 << 30), limit=1 << 30)
"""

from __future__ import annotations

from typing import Any, Iterator

from jaxmem.errors import ConfigError, OutOfMemory
from jaxmem.runtime.allocator import Allocator, Chunk
from jaxmem.runtime.dump import OomWatch, PoolOutOfMemory
from jaxmem.trace_schema import Event, Segment, Trace
from jaxmem.units import format_size


def _forward(name: str) -> property:
    # The base class writes these counters in __init__; for a wrapper they are the wrapped
    # allocator's, so reads forward and the base class's initial writes are dropped.
    return property(lambda self: getattr(self.inner, name), lambda self, value: None)


class Adaptor(Allocator):
    """An allocator that hands every request to `inner` and returns its buffers' placement.

    >>> from jaxmem.runtime.registry import make_allocator
    >>> from jaxmem.runtime.backends import SimulatedBackend
    >>> wrapped = Adaptor(make_allocator("bfc", SimulatedBackend("1GiB"), limit=1 << 30))
    >>> wrapped.allocate(1000).size
    1024

    Args:
        inner: the allocator to wrap (itself possibly an adaptor).
    """

    device_allocs = _forward("device_allocs")
    device_alloc_bytes = _forward("device_alloc_bytes")
    device_frees = _forward("device_frees")

    def __init__(self, inner: Allocator, limit: int | None = None) -> None:
        if not isinstance(inner, Allocator):
            raise ConfigError(f"an adaptor wraps an Allocator, got {type(inner).__name__}")
        self.inner = inner
        super().__init__(inner.backend, inner.limit if limit is None else limit)
        self.name = inner.name

    def __getattr__(self, name: str) -> Any:
        # Policy attributes (preallocate, regions(), ...) are the wrapped allocator's.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def _allocate(self, size: int, alignment: int, stream: int) -> tuple[int, int, object]:
        buf = self.inner.allocate(size, alignment=alignment, stream=stream)
        return buf.address, buf.size, buf

    def _free(self, address: int, size: int, handle: object, stream: int) -> None:
        self.inner.free(handle)  # type: ignore[arg-type]

    def _pool_bytes(self) -> int:
        return self.inner._pool_bytes()

    def _largest_free_block(self) -> int:
        return self.inner._largest_free_block()

    def _empty_cache(self) -> int:
        return self.inner.empty_cache()

    def _chunks(self) -> Iterator[Chunk]:
        return self.inner.chunks()

    def reset_peak_stats(self) -> None:
        self.inner.reset_peak_stats()
        super().reset_peak_stats()

    def memory_stats(self) -> dict[str, int | float]:
        stats = super().memory_stats()
        stats["peak_pool_bytes"] = self.inner.memory_stats()["peak_pool_bytes"]
        return stats


class LimitingAdaptor(Adaptor):
    """Refuse any allocation that would put more than `limit` bytes in use through this wrapper.

    The request, rounded to 256 bytes, is checked before the wrapped allocator is asked, so a
    refusal changes nothing. If the wrapped allocator then hands out more than was asked (a
    whole BFC chunk) and that crosses the limit, the buffer is freed again and the call fails;
    a region the wrapped pool grew for it stays, as RMM's limiting adaptor leaves its upstream.

    >>> from jaxmem.runtime.registry import make_allocator
    >>> from jaxmem.runtime.backends import SimulatedBackend
    >>> capped = LimitingAdaptor(make_allocator("platform", SimulatedBackend("1GiB"), limit=1 << 30), limit=4096)
    >>> capped.allocate(4096).size
    4096

    Args:
        inner: the allocator to wrap.
        limit: bytes in use allowed through this wrapper.
    """

    def __init__(self, inner: Allocator, limit: int) -> None:
        if type(limit) is not int or limit <= 0:
            raise ConfigError(f"a limit must be a positive int of bytes, got {limit!r}")
        super().__init__(inner, limit)
        self._oom = OomWatch()

    def _refuse(self, size: int, rounded: int) -> OutOfMemory:
        return self._oom.track(PoolOutOfMemory(
            f"{self.name} (limited to {format_size(self.limit)}) refused {format_size(size)} ({size} bytes, "
            f"rounded to {rounded}); in use {format_size(self.bytes_in_use)}, pool "
            f"{format_size(self._pool_bytes())}; cause: the limit",
            lambda: list(self.inner.chunks()), requested=size, rounded=rounded, in_use=self.bytes_in_use,
            pool_bytes=self._pool_bytes(), limit=self.limit, largest_free_block=self._largest_free_block(),
            fragmentation=False))

    def _free(self, address: int, size: int, handle: object, stream: int) -> None:
        if self._oom.pending:
            self._oom.settle()
        self.inner.free(handle)  # type: ignore[arg-type]

    def _empty_cache(self) -> int:
        if self._oom.pending:
            self._oom.settle()
        return self.inner.empty_cache()

    def _allocate(self, size: int, alignment: int, stream: int) -> tuple[int, int, object]:
        if self._oom.pending:
            self._oom.settle()
        rounded = (size + 255) & -256
        if self.bytes_in_use + rounded > self.limit:
            raise self._refuse(size, rounded)
        buf = self.inner.allocate(size, alignment=alignment, stream=stream)
        if self.bytes_in_use + buf.size > self.limit:
            self.inner.free(buf)
            raise self._refuse(size, buf.size)
        return buf.address, buf.size, buf


class _RecordingBackend:
    """Forwards to a backend and records each device allocation and release as a trace event."""

    def __init__(self, backend: Any, events: list) -> None:
        self._backend = backend
        self._events = events

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def reserve(self, size: int, alignment: int = 256) -> int | None:
        address = self._backend.reserve(size, alignment)
        if address is not None:
            self._events.append(_event("segment_alloc", address, size))
        return address

    def release(self, address: int) -> None:
        size = self._backend.allocations.get(address, 0)
        self._backend.release(address)
        self._events.append(_event("segment_free", address, size))


def _event(action: str, address: int, size: int, requested: int | None = None, stream: int = 0):
    return Event(action=action, addr=address, size=size, stream=stream, requested=requested)


class TrackingAdaptor(Adaptor):
    """Record every allocation, free, out-of-memory and device allocation as jaxmem trace
    events, so a run through any pool can be replayed through another or reported on.

    >>> from jaxmem.runtime.registry import make_allocator
    >>> from jaxmem.runtime.backends import SimulatedBackend
    >>> recorder = TrackingAdaptor(make_allocator("bfc-growth", SimulatedBackend("1GiB"), limit=1 << 30))
    >>> recorder.free(recorder.allocate(1000))
    >>> [e.action for e in recorder.events]
    ['segment_alloc', 'alloc', 'free']

    Args:
        inner: the allocator to wrap. Its backend is wrapped too, to see its device calls.
    """

    def __init__(self, inner: Allocator) -> None:
        super().__init__(inner)
        self.events: list = []
        # The innermost allocator calls the backend; give it one that records.
        innermost = inner
        while isinstance(innermost, Adaptor):
            innermost = innermost.inner
        # device allocations made before tracking began (a preallocated pool's region)
        self._initial = dict(getattr(innermost.backend, "allocations", {}))
        innermost.backend = _RecordingBackend(innermost.backend, self.events)

    def _allocate(self, size: int, alignment: int, stream: int) -> tuple[int, int, object]:
        try:
            buf = self.inner.allocate(size, alignment=alignment, stream=stream)
        except OutOfMemory:
            self.events.append(_event("oom", 0, size, size, stream))
            raise
        self.events.append(_event("alloc", buf.address, buf.size, size, stream))
        return buf.address, buf.size, buf

    def _free(self, address: int, size: int, handle: object, stream: int) -> None:
        self.inner.free(handle)  # type: ignore[arg-type]
        self.events.append(_event("free", address, size, None, stream))

    def trace(self):
        """The events so far as a `jaxmem.trace_schema.Trace`; device allocations made before
        tracking began are its `initial_segments`."""
        backend = self.backend
        initial = [Segment(addr=a, size=n) for a, n in sorted(self._initial.items())]
        return Trace(events=list(self.events), format="jaxmem", source=f"jaxmem {self.name} pool",
                     initial_segments=initial,
                     allocator_settings={"allocator": self.name, "limit": self.limit,
                                         "capacity": getattr(backend, "capacity", 0)})


def track(device: Any) -> TrackingAdaptor:
    """Wrap `device.allocator` in a `TrackingAdaptor`, in place; wrap before allocating.

    Returns:
        The adaptor; its `events` grow as the device is used, `trace()` returns them.
    """
    recorder = TrackingAdaptor(device.allocator)
    device.allocator = recorder
    return recorder
