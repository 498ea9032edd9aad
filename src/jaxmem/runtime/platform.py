"""JAX's `platform` allocator: no pool; every buffer is its own device allocation.

With `XLA_PYTHON_CLIENT_ALLOCATOR=platform` JAX calls the driver (cudaMalloc/cudaFree) for
each buffer and returns the memory at once on free. Nothing is cached, so nothing fragments
inside a pool, but every allocation pays a driver call. Here each buffer is one exact
`backend.reserve(size)`; the pool is exactly the bytes in use.

    pool = PlatformAllocator(SimulatedBackend("16GiB"), limit=16 << 30)
    buf = pool.allocate(1000)        # Buffer(address=0x0, size=1000, requested_size=1000)
    pool.free(buf)                   # back to the device now
"""

from __future__ import annotations

from typing import Iterator

from jaxmem.runtime.allocator import Allocator, Backend, Chunk
from jaxmem.runtime.dump import OomWatch, PoolOutOfMemory
from jaxmem.units import format_size


class PlatformAllocator(Allocator):
    """One exact device allocation per buffer, released on free.

    >>> from jaxmem.runtime.backends import SimulatedBackend
    >>> pool = PlatformAllocator(SimulatedBackend("1GiB"), limit=1 << 30)
    >>> pool.allocate(1000).size
    1000

    Args:
        backend: the device.
        limit: most bytes in use at once (JAX's platform allocator has no fraction cap; the
            device's capacity is the natural limit).
    """

    name = "platform"

    def __init__(self, backend: Backend, limit: int, *, name: str | None = None) -> None:
        super().__init__(backend, limit)
        if name is not None:
            self.name = name
        self._live: dict[int, int] = {}  # address -> size, for chunks()
        self._oom = OomWatch()

    def _allocate(self, size: int, alignment: int, stream: int) -> tuple[int, int, object]:
        if self._oom.pending:
            self._oom.settle()
        address = None
        if self.bytes_in_use + size <= self.limit:
            address = self.backend.reserve(size, alignment)
        if address is None:
            raise self._out_of_memory(size)
        self._live[address] = size
        self.device_allocs += 1
        self.device_alloc_bytes += size
        pool = self.bytes_in_use + size
        if pool > self.peak_pool_bytes:
            self.peak_pool_bytes = pool
        return address, size, None

    def _free(self, address: int, size: int, handle: object, stream: int) -> None:
        if self._oom.pending:
            self._oom.settle()
        del self._live[address]
        self.backend.release(address)
        self.device_frees += 1

    def _pool_bytes(self) -> int:
        return self.bytes_in_use

    def _largest_free_block(self) -> int:
        return 0  # no pool, so no free block inside it

    def _chunks(self) -> Iterator[Chunk]:
        for index, address in enumerate(sorted(self._live)):
            yield Chunk(address, self._live[address], True, index)

    def _out_of_memory(self, size: int) -> PoolOutOfMemory:
        reserved = getattr(self.backend, "reserved", self.bytes_in_use)
        capacity = getattr(self.backend, "capacity", self.limit)
        free_total = min(self.limit - self.bytes_in_use, capacity - reserved)
        fragmented = free_total >= size
        cause = "; cause: fragmentation of the device's address space" if fragmented else ""
        message = (
            f"{self.name} ran out of memory trying to allocate {format_size(size)} ({size} bytes, "
            f"rounded to {size}); in use {format_size(self.bytes_in_use)}, pool "
            f"{format_size(self.bytes_in_use)} of limit {format_size(self.limit)}, largest free "
            f"block 0 B (no pool){cause}")
        return self._oom.track(PoolOutOfMemory(
            message, lambda: list(self._chunks()), requested=size, rounded=size,
            in_use=self.bytes_in_use, pool_bytes=self.bytes_in_use, limit=self.limit,
            largest_free_block=0, fragmentation=fragmented))
