"""Device memory as a driver hands it out: simulated addresses, or one real host buffer.

A backend is what `cudaMalloc`/`cudaFree` are to XLA's BFC allocator: it gives out whole
allocations ("regions") and takes them back whole. Both backends here place a new allocation
at the lowest address where it fits (address-ordered first fit), so the regions a growing pool
asks for one after another tend to sit next to each other, as they do on a fresh GPU. The
simulated one refuses only when its bytes run out; the host one also needs a contiguous gap
in its one real buffer.

    backend = SimulatedBackend(capacity=1 << 30)
    a = backend.reserve(2 << 20)        # 0
    b = backend.reserve(4 << 20)        # 2097152, right after a
    backend.release(a)

A CUDA pool would be a third class with the same four members (`kind`, `capacity`, `reserve`,
`release`, and `view` if it can expose bytes); the allocators need nothing else.
"""

from __future__ import annotations

import mmap
import sys

from bisect import bisect_left, insort

from jaxmem.errors import AllocationError, ConfigError
from jaxmem.units import parse_size

# cudaMalloc returns addresses aligned to at least 256 bytes; the simulated driver does the same.
DEVICE_ALIGNMENT = 256
# Virtual addresses per byte of a simulated device (see SimulatedBackend).
VIRTUAL_FACTOR = 64


class _FirstFit:
    """Free address ranges of [0, capacity), answering "lowest address where `size` fits".

    Gaps are grouped by size class (floor(log2(size))). Every gap in a class above the
    request's class fits, so its lowest address is a candidate in O(1); only the request's own
    class needs a scan, and the scan stops as soon as it passes the best candidate.
    """

    def __init__(self, capacity: int) -> None:
        self.start_size: dict[int, int] = {0: capacity}   # gap start -> gap size
        self.end_start: dict[int, int] = {capacity: 0}    # gap end -> gap start
        self.classes: dict[int, list[int]] = {capacity.bit_length() - 1: [0]}  # class -> starts

    def _add(self, start: int, size: int) -> None:
        self.start_size[start] = size
        self.end_start[start + size] = start
        insort(self.classes.setdefault(size.bit_length() - 1, []), start)

    def _remove(self, start: int) -> int:
        size = self.start_size.pop(start)
        del self.end_start[start + size]
        starts = self.classes[size.bit_length() - 1]
        del starts[bisect_left(starts, start)]
        return size

    def take(self, size: int, alignment: int) -> int | None:
        """Carve `size` bytes at the lowest aligned address that fits; None if nowhere fits."""
        # Any gap of at least size + alignment - 1 bytes fits whatever its start; smaller gaps
        # (classes lo..hi) are checked one by one, in address order, with their real start.
        lo = size.bit_length() - 1
        hi = (size + alignment - 1).bit_length() - 1
        best: int | None = None
        for c, starts in self.classes.items():
            if c > hi and starts and (best is None or starts[0] < best):
                best = starts[0]
        start_size = self.start_size
        for c in range(lo, hi + 1):
            for start in self.classes.get(c, ()):
                if best is not None and start > best:
                    break
                if -(-start // alignment) * alignment + size <= start + start_size[start]:
                    best = start
                    break
        if best is None:
            return None
        gap = self._remove(best)
        address = -(-best // alignment) * alignment
        if address > best:
            self._add(best, address - best)
        end, gap_end = address + size, best + gap
        if gap_end > end:
            self._add(end, gap_end - end)
        return address

    def give_back(self, address: int, size: int) -> None:
        """Return [address, address+size) and merge it with the free ranges on either side."""
        end = address + size
        if end in self.start_size:
            end += self._remove(end)
        before = self.end_start.get(address)
        if before is not None:
            self._remove(before)
            address = before
        self._add(address, end - address)


class SimulatedBackend:
    """Addresses only: any capacity, no memory behind it. The allocator tests run on this.

    Like cudaMalloc, it refuses only when its bytes run out: addresses come from a virtual
    range 64 times the capacity (a GPU maps physical pages behind fresh virtual addresses,
    so free memory scattered between live allocations still serves a large request).

    >>> backend = SimulatedBackend("80GiB")
    >>> backend.reserve(1024), backend.reserve(1024)
    (0, 1024)

    Args:
        capacity: bytes, "80GiB", or a preset name such as "h100-80gb".
        address_space: bytes of addresses to place allocations in (default 64 x capacity);
            equal to the capacity, allocations must also find a contiguous gap.
    """

    kind = "simulated"

    def __init__(self, capacity: int | str, *, address_space: int | None = None) -> None:
        self.capacity = parse_size(capacity)
        self.reserved = 0                      # bytes currently handed out
        self.allocations: dict[int, int] = {}  # address -> size
        space = VIRTUAL_FACTOR * self.capacity if address_space is None else address_space
        if space < self.capacity:
            raise ConfigError(f"address space {space} is smaller than the capacity {self.capacity}")
        self._space = _FirstFit(space)

    def reserve(self, size: int, alignment: int = DEVICE_ALIGNMENT) -> int | None:
        """Address of a new allocation of `size` bytes, or None if the device cannot supply it."""
        if size <= 0:
            raise AllocationError(f"backend reserve size must be positive, got {size}")
        alignment = max(alignment, DEVICE_ALIGNMENT)
        if self.reserved + size > self.capacity:
            return None
        address = self._space.take(size, alignment)
        if address is None:
            return None
        self.allocations[address] = size
        self.reserved += size
        return address

    def release(self, address: int) -> None:
        """Give back the allocation that starts at `address`, whole."""
        size = self.allocations.pop(address, None)
        if size is None:
            raise AllocationError(f"backend release of unknown address {address:#x}")
        self.reserved -= size
        self._space.give_back(address, size)

    def view(self, address: int, size: int):
        raise AllocationError("a simulated device has addresses only, no bytes to view; use backend='host'")


# Private anonymous memory, not counted against the commit limit until written. Python's mmap
# module names MAP_NORESERVE only from 3.12; 0x4000 is its value on Linux.
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_LAZY_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _NORESERVE


class HostBackend(SimulatedBackend):
    """The whole device is one real numpy uint8 buffer; `view` exposes a buffer's bytes.

    The buffer is an anonymous mapping made with MAP_NORESERVE: pages nobody writes cost no
    memory, and a device larger than the free memory can be made (with preallocation off,
    only what is used is ever backed). Writing more than the machine has still fails, as it
    would on the device.

    >>> backend = HostBackend("1MiB")
    >>> address = backend.reserve(256)
    >>> backend.view(address, 4)[:] = 7

    Args:
        capacity: bytes or a size string; it must fit in this machine's address space.
    """

    kind = "host"

    def __init__(self, capacity: int | str) -> None:
        import numpy as np

        # The bytes are real, so the addresses are exactly the buffer's.
        super().__init__(capacity, address_space=parse_size(capacity))
        try:
            self._mapping = mmap.mmap(-1, max(1, self.capacity), flags=_LAZY_FLAGS)
        except (OSError, OverflowError, ValueError) as err:
            raise ConfigError(f"cannot back a host device of {self.capacity} bytes: {err}") from None
        self.memory = np.frombuffer(self._mapping, dtype=np.uint8, count=self.capacity)

    def view(self, address: int, size: int):
        """A writable numpy uint8 view of `size` bytes at `address`, an array of its own: every
        view made from it (slices, `.view(dtype)`, reshapes) keeps it alive, so a weak reference
        to it says whether any view of these bytes is left (`Device.free` relies on that)."""
        import numpy as np

        if address < 0 or size < 0 or address + size > self.capacity:
            raise AllocationError(f"view [{address:#x}, +{size}) lies outside the {self.capacity}-byte device")
        if size == 0:
            return self.memory[address:address]
        return np.frombuffer(self._mapping, dtype=np.uint8, count=size, offset=address)


BACKENDS = {"simulated": SimulatedBackend, "host": HostBackend}


def make_backend(kind: str, capacity: int | str) -> SimulatedBackend:
    """The backend named `kind` ("simulated" or "host") with `capacity` bytes.

    >>> make_backend("simulated", "16GiB").capacity == 16 << 30
    True
    """
    if kind not in BACKENDS:
        raise ConfigError(f"unknown backend {kind!r}; one of: {', '.join(BACKENDS)}")
    return BACKENDS[kind](capacity)
