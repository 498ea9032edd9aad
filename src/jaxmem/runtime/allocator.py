"""The allocator contract every pool in jaxmem follows.

An allocator carves device memory that a `Backend` hands it (simulated addresses, a host
numpy buffer, later a CUDA pool); it never touches a device itself. One public
`allocate`/`free` pair, written once here, validates the call and keeps the statistics; each
allocator supplies only its policy through the private hooks `_allocate`, `_free`,
`_largest_free_block`, `_empty_cache` and `_chunks`.

Replaying a recorded stream (`jaxmem.traces.replay`) goes through public verbs too:
`replay_pair()` hands out the policy without a Buffer per call, `settle_replay()` writes back the
statistics the loop kept, `release_segment_at()` replays a recorded cudaFree, and allocators that
can rebuild recorded segments say so with `adopts_segments` (see `CachingAllocator.adopt_segment`).

    backend = SimulatedBackend(capacity=16 * GiB)
    alloc = BFCAllocator(backend, limit=12 * GiB, preallocate=True)
    buf = alloc.allocate(1000)        # Buffer(address=0x0, size=1024, requested_size=1000)
    alloc.free(buf)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator, NamedTuple, Protocol

from jaxmem.errors import AllocationError


class Backend(Protocol):
    """Device memory as the driver gives it (cudaMalloc / cudaFree, or their stand-ins).

    `reserve(size, alignment=256)` returns the address of a new device allocation, or None
    when the device cannot supply it (that is not an error: allocators back off and retry).
    `release` returns one allocation whole. `view` returns a writable numpy uint8 view (host
    backend only). `reserved` is the bytes handed out now; `allocations` maps each live
    allocation's address to its size. A CUDA pool would implement these same members.
    """

    kind: str
    capacity: int
    reserved: int
    allocations: dict[int, int]

    def reserve(self, size: int, alignment: int = 256) -> int | None: ...
    def release(self, address: int) -> None: ...
    def view(self, address: int, size: int): ...  # -> numpy.ndarray


class ReplayPair(NamedTuple):
    """An allocator's policy for a replay loop: no checks, no Buffer and no statistics per call.

    Two shapes, named by `blocks`, so that neither pays for a wrapper on the hot path:
      blocks False (the default): `allocate(size, alignment, stream) -> (address, size, handle)`
        and `free(address, size, handle, stream)`: the allocator's own hooks.
      blocks True: `allocate(size, stream) -> block` and `free(block)`, where the block has
        `.addr` and `.size` (read the size before freeing: merging may grow the block).
    Either raises OutOfMemory leaving the pool as it was. The caller keeps `bytes_in_use` itself
    and hands it to `Allocator.settle_replay` when the loop ends.

        pair = alloc.replay_pair()
        address, size, handle = pair.allocate(1000, 256, 0)   # size == 1024
        pair.free(address, size, handle, 0)
    """

    allocate: Callable[..., Any]
    free: Callable[..., None]
    blocks: bool


class Chunk(NamedTuple):
    """One piece of the pool as the allocator sees it: for maps, dumps and invariant checks."""

    address: int
    size: int
    in_use: bool
    region: int  # index of the backend allocation (region/segment) it lies in


class Buffer:
    """A live allocation. `address` is a byte offset in the device's address space, `size` the
    bytes reserved for it after rounding, `requested_size` what the caller asked for."""

    __slots__ = ("address", "size", "requested_size", "stream", "owner", "live", "handle")

    def __init__(self, address: int, size: int, requested_size: int, stream: int, owner: object, handle: object = None) -> None:
        self.address = address
        self.size = size
        self.requested_size = requested_size
        self.stream = stream
        self.owner = owner
        self.live = True
        self.handle = handle  # allocator-private bookkeeping (e.g. the chunk record)

    def __repr__(self) -> str:
        state = "" if self.live else ", freed"
        return f"Buffer(address={self.address:#x}, size={self.size}, requested_size={self.requested_size}{state})"


def _check_request(size: object, alignment: object) -> None:
    """Raise the AllocationError that says what is wrong with an allocate() call."""
    if type(size) is not int:  # bool and float are refused too
        raise AllocationError(f"allocation size must be an int, got {size!r}")
    if size <= 0:
        raise AllocationError(f"allocation size must be positive, got {size}")
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise AllocationError(f"alignment must be a power of two, got {alignment!r}")


class Allocator(ABC):
    """Base class: the public allocate/free pair and the statistics; subclasses give the policy.

    Subclass hooks:
      _allocate(size, alignment, stream) -> (address, reserved_size, handle)   or raise OutOfMemory
      _free(address, reserved_size, handle, stream) -> None
      _pool_bytes() -> bytes currently held from the backend
      _largest_free_block() -> bytes
      _empty_cache() -> bytes returned to the backend
      _chunks() -> iterator of Chunk, address order
    """

    name = "allocator"

    def __init__(self, backend: Backend, limit: int) -> None:
        self.backend = backend
        self.limit = limit
        self.num_allocs = 0
        self.bytes_in_use = 0
        self.peak_bytes_in_use = 0
        self.largest_alloc_size = 0
        self.peak_pool_bytes = 0
        self.device_allocs = 0          # backend.reserve calls that succeeded (cudaMalloc count)
        self.device_alloc_bytes = 0
        self.device_frees = 0

    # ---- the one public pair -------------------------------------------------------------
    def allocate(self, size: int, *, alignment: int = 256, stream: int = 0) -> Buffer:
        """A buffer of at least `size` bytes (raises OutOfMemory; the pool is then unchanged)."""
        # One test on the common path; the slow path says exactly what is wrong.
        if type(size) is not int or size <= 0 or (alignment != 256 and (
                type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1))):
            _check_request(size, alignment)
        address, reserved, handle = self._allocate(size, alignment, stream)
        self.num_allocs += 1
        in_use = self.bytes_in_use + reserved
        self.bytes_in_use = in_use
        if in_use > self.peak_bytes_in_use:
            self.peak_bytes_in_use = in_use
        if reserved > self.largest_alloc_size:
            self.largest_alloc_size = reserved
        return Buffer(address, reserved, size, stream, self, handle)

    def free(self, buffer: Buffer) -> None:
        """Give `buffer` back; a double free or a buffer of another allocator is refused."""
        if type(buffer) is not Buffer or buffer.owner is not self or not buffer.live:
            self._check_free(buffer)
        self._free(buffer.address, buffer.size, buffer.handle, buffer.stream)
        buffer.live = False
        self.bytes_in_use -= buffer.size

    def _check_free(self, buffer: object) -> None:
        if not isinstance(buffer, Buffer):
            raise AllocationError(f"free() takes a Buffer, got {type(buffer).__name__}")
        if buffer.owner is not self:
            raise AllocationError(f"{buffer!r} was not allocated by this device's allocator")
        if not buffer.live:
            raise AllocationError(f"double free of {buffer!r}")

    def empty_cache(self) -> int:
        """Return wholly free regions to the backend; returns the bytes given back."""
        return self._empty_cache()

    def chunks(self) -> Iterator[Chunk]:
        return self._chunks()

    def largest_free_block(self) -> int:
        """Bytes in the largest free block of the pool (0 without a pool)."""
        return self._largest_free_block()

    # ---- replaying a recorded stream -----------------------------------------------------
    adopts_segments = False     # True where `adopt_segment` rebuilds a recorded segment in place

    def replay_pair(self) -> ReplayPair:
        """The policy without the public pair's per-call checks and statistics (see ReplayPair);
        by default the `_allocate`/`_free` hooks themselves."""
        return ReplayPair(self._allocate, self._free, False)

    def settle_replay(self, bytes_in_use: int, allocs: int, peak_bytes_in_use: int) -> None:
        """Write back the statistics a replay loop kept: the bytes in use at its end, the
        allocations it made through `replay_pair` and the peak of the bytes in use."""
        self.bytes_in_use = bytes_in_use
        self.num_allocs += allocs
        if peak_bytes_in_use > self.peak_bytes_in_use:
            self.peak_bytes_in_use = peak_bytes_in_use

    def release_segment_at(self, address: int) -> bool:
        """Replay a recorded cudaFree: give the backend allocation at `address` back if it is
        wholly free; returns whether it was (default: never, the allocator keeps its pool)."""
        return False

    def reset_peak_stats(self) -> None:
        self.peak_bytes_in_use = self.bytes_in_use
        self.peak_pool_bytes = self._pool_bytes()

    def memory_stats(self) -> dict[str, int | float]:
        """The keys and meanings of `jax.Device.memory_stats()`, plus XLA's fragmentation."""
        pool = self._pool_bytes()
        largest_free = self._largest_free_block()
        free = pool - self.bytes_in_use
        return {
            "num_allocs": self.num_allocs,
            "bytes_in_use": self.bytes_in_use,
            "peak_bytes_in_use": self.peak_bytes_in_use,
            "largest_alloc_size": self.largest_alloc_size,
            "bytes_limit": self.limit,
            "bytes_reserved": 0,
            "peak_bytes_reserved": 0,
            "bytes_reservable_limit": 0,
            "largest_free_block_bytes": largest_free,
            "pool_bytes": pool,
            "peak_pool_bytes": max(self.peak_pool_bytes, pool),
            "fragmentation": (free - largest_free) / free if free > 0 else 0.0,
        }

    # ---- hooks -----------------------------------------------------------------------------
    @abstractmethod
    def _allocate(self, size: int, alignment: int, stream: int) -> tuple[int, int, object]:
        """Place a validated request: (address, bytes reserved, handle), or raise OutOfMemory
        leaving the pool exactly as it was."""

    @abstractmethod
    def _free(self, address: int, size: int, handle: object, stream: int) -> None:
        """Take back a live buffer (the public `free` has already checked it)."""

    @abstractmethod
    def _pool_bytes(self) -> int:
        """Bytes currently held from the backend."""

    @abstractmethod
    def _largest_free_block(self) -> int:
        """Bytes in the largest free block of the pool (0 without a pool)."""

    def _empty_cache(self) -> int:
        """Return what can be returned to the backend; the bytes given back (default: none)."""
        return 0

    @abstractmethod
    def _chunks(self) -> Iterator[Chunk]:
        """Every chunk of the pool, address order."""
