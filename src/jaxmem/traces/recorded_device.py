"""A simulated device that hands out the addresses a recorded device handed out.

Where cudaMalloc puts a segment is the driver's choice, not the caching allocator's, yet the
allocator's best fit breaks ties between equal-size free blocks by address. To replay a
snapshot faithfully the model must see the same addresses the real allocator saw: the start
state's segments at their recorded addresses, and each new segment at the address of the
recorded segment_alloc of that size, in order. When the model asks for a size the recording
does not have next (it diverged), the segment goes to a fresh address above everything recorded.

    device = RecordedDevice(trace, capacity=80 << 30)
    model = make_caching_allocator(device, limit=device.capacity)
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import deque

from jaxmem.errors import AllocationError
from jaxmem.runtime.backends import SimulatedBackend
from jaxmem.traces.model import Trace

_LOOKAHEAD = 8      # how far ahead in the recorded segment_allocs a size is looked for


class RecordedDevice:
    """Backend protocol (`reserve`, `release`, `capacity`, `reserved`) over recorded addresses.

    Args:
        trace: a trace with recorded segment addresses (a PyTorch snapshot).
        capacity: device bytes; reserve() refuses past it, as cudaMalloc would.
    """

    kind = "recorded"

    def __init__(self, trace: Trace, capacity: int) -> None:
        self.capacity = capacity
        self.reserved = 0
        self.recorded_hits = 0                 # segments placed at their recorded address
        self.fresh = 0                         # segments placed at a fresh address
        initial = sorted((s.addr, s.size) for s in trace.initial_segments)
        window = [(e.addr, e.size) for e in trace.events if e.action == "segment_alloc"]
        self._queue: deque[tuple[int, int]] = deque(initial + window)
        top = max((a + n for a, n in initial + window), default=0)
        self._base = -(-top // (2 << 20)) * (2 << 20) + (2 << 20)
        self._fallback = SimulatedBackend(capacity * 64)   # ample addresses; bytes are checked above
        self._held: dict[int, int] = {}        # address -> size, all live allocations
        self._starts: list[int] = []

    def _free_range(self, addr: int, size: int) -> bool:
        k = bisect_left(self._starts, addr)
        if k < len(self._starts) and self._starts[k] < addr + size:
            return False
        return not (k > 0 and self._starts[k - 1] + self._held[self._starts[k - 1]] > addr)

    def reserve(self, size: int, alignment: int = 256) -> int | None:
        """The recorded address for the next segment of this size, else a fresh one; None when full."""
        if size <= 0:
            raise AllocationError(f"backend reserve size must be positive, got {size}")
        if self.reserved + size > self.capacity:
            return None
        addr = None
        for k, (a, n) in enumerate(self._queue):
            if k >= _LOOKAHEAD:
                break
            if n == size and self._free_range(a, size):
                addr = a
                del self._queue[k]
                self.recorded_hits += 1
                break
        if addr is None:
            sim = self._fallback.reserve(size, alignment)
            if sim is None:
                return None
            addr = self._base + sim
            self.fresh += 1
        self._held[addr] = size
        insort(self._starts, addr)
        self.reserved += size
        return addr

    def release(self, address: int) -> None:
        """Give back a whole allocation."""
        size = self._held.pop(address, None)
        if size is None:
            raise AllocationError(f"backend release of unknown address {address:#x}")
        del self._starts[bisect_left(self._starts, address)]
        self.reserved -= size
        if address >= self._base:
            self._fallback.release(address - self._base)

    def view(self, address: int, size: int):
        raise AllocationError("a recorded device has addresses only, no bytes to view")
