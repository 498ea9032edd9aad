"""XLA/TSL's best-fit-with-coalescing (BFC) allocator, the pool JAX uses on GPU and TPU.

The policy, as in tsl/framework/bfc_allocator.cc:
  * a request is rounded up to a multiple of 256 bytes; every chunk starts 256-aligned;
  * free chunks sit in 21 bins, bin i holding sizes in [256 << i, 256 << (i+1)), the last
    everything from 256 MiB up; a request searches from its own bin upward and takes the
    smallest free chunk that fits, the lowest address among equal sizes;
  * the chunk is split only when it is at least twice the rounded request or the leftover
    would be 128 MiB or more (otherwise the caller gets the whole chunk);
  * a freed chunk merges at once with free neighbours;
  * preallocated: one region of the limit at creation. Growth: regions of 2 MiB, then twice
    that each time the pool grows, never past the limit; when the device cannot supply a
    region, ask again for 0.9x as much, down to the request. Regions the device hands out
    side by side merge into one.

How the free set is held, and why:
  * Searching bins upward for the first chunk that fits in (size, address) order finds the
    same chunk as one search over all free chunks ordered by (size, address), so one ordered
    container holds them all, keyed by single ints, size << 48 | address (they compare faster
    than tuples).
  * Up to 512 free chunks sit in one flat sorted list (a C bisect plus one list edit per
    operation); beyond that, in sublists of 256 with a list of their last keys, as
    sortedcontainers lays them out, so an insert never moves more than a few KB. Both paths are
    written out inline because the public allocate/free pair is the hot path.
  * In sublists a free only notes its chunk; the next reader of the free set (an allocation,
    the statistics, the chunk walk, empty_cache) merges the notes first, one by one or, after a
    long run of frees, by one vectorized sort, as glibc's unsorted bin defers the same work. So
    the pool observed is always the one that merged at once, and draining a pool costs no
    sorted edits per free.
  * Free chunks are also kept in two dictionaries (start -> size, end -> start): all a free
    needs to find the neighbours it merges with. Chunks in use are not tabled (a large table
    falls out of cache): the chunk walk reads them off the live buffers the public allocate
    handed out. Allocations through the hooks alone (trace replay) have no Buffer, so they are
    tabled.

`benchmarks/results/runtime.md` has the measurements behind these choices (XLA's own layout,
21 per-bin sorted lists and a bitmask, is slower here).

    backend = SimulatedBackend("16GiB")
    pool = BFCAllocator(backend, limit=12 << 30, preallocate=True)
    buf = pool.allocate(1000)         # Buffer(address=0x0, size=1024, requested_size=1000)
    pool.free(buf)
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Iterator
from weakref import ref as _weakref

import numpy as np

from jaxmem.errors import AllocationError, ConfigError, OutOfMemory
from jaxmem.runtime.allocator import Allocator, Backend, Buffer, Chunk
from jaxmem.runtime.dump import MIN_ALLOCATION, NUM_BINS, OomWatch, PoolOutOfMemory, bin_for_size  # noqa: F401 (re-exported)
from jaxmem.units import format_size

MAX_INTERNAL_FRAGMENTATION = 128 << 20   # split anyway when the leftover is this big
INITIAL_REGION = 2 << 20                 # growth mode's first region
BACKPEDAL = 0.9                          # shrink factor when the device refuses a region

_SHIFT = 48                              # key = size << 48 | address; addresses < 256 TiB
_MASK = (1 << _SHIFT) - 1
_LOAD = 256                              # sublist length; split at twice this
_new = object.__new__                    # a Buffer without the cost of a Python __init__ call
_MIN_SWEEP = 1024                        # `_issued` is swept at 2 x live buffers + this


def round_bytes(size: int) -> int:
    """`size` rounded up to a multiple of 256, as BFC does.

    >>> round_bytes(1), round_bytes(256), round_bytes(257)
    (256, 256, 512)
    """
    return (size + MIN_ALLOCATION - 1) & -MIN_ALLOCATION


class BFCAllocator(Allocator):
    """XLA's BFC pool over a backend, preallocated or growing.

    >>> from jaxmem.runtime.backends import SimulatedBackend
    >>> pool = BFCAllocator(SimulatedBackend("1GiB"), limit=768 << 20)
    >>> pool.allocate(1000).size
    1024

    Args:
        backend: where regions come from (`SimulatedBackend`, `HostBackend`, ...).
        limit: most bytes the pool may hold (mem_fraction x capacity in JAX).
        preallocate: take one region of `limit` now (JAX's default) instead of growing.
        name: shown in messages, like XLA's "GPU_0_bfc".
    """

    name = "bfc"

    def __init__(self, backend: Backend, limit: int, *, preallocate: bool = True, name: str | None = None) -> None:
        if type(limit) is not int or limit < MIN_ALLOCATION:
            raise AllocationError(f"pool limit must be an int of at least 256 bytes, got {limit!r}")
        if getattr(backend, "capacity", 0) > _MASK:
            raise ConfigError(f"a BFC pool addresses at most {_MASK + 1} bytes (256 TiB), "
                              f"the device has {backend.capacity}")
        super().__init__(backend, limit)
        if name is not None:
            self.name = name
        self.preallocate = preallocate
        self.pool_bytes = 0
        self._flat: list[int] | None = []    # all free-chunk keys, sorted, while they are few
        self._maxes: list[int] = []          # otherwise: last key of each sublist
        self._lists: list[list[int]] = []    # ... and the sorted sublists of free-chunk keys
        self._freed: list[int] = []          # sublists only: address, size of chunks freed, not merged yet
        self._used: dict[int, int] = {}        # chunk in use through the hooks: address -> size
        self._issued: list[Buffer] = []        # buffers the public allocate handed out, some freed since
        self._sweep_at = _MIN_SWEEP            # ... swept of freed ones when it grows past this
        self._free_start: dict[int, int] = {}  # free chunk: address -> size (to merge forwards)
        self._free_end: dict[int, int] = {}    # free chunk: end -> address (to merge backwards)
        self._regions: dict[int, int] = {}   # region start -> end (adjacent regions merged)
        self._region_end: dict[int, int] = {}  # region end -> start
        self._parts: dict[int, list[tuple[int, int]]] = {}  # region start -> backend allocations
        self._oom = OomWatch()               # the last OutOfMemory, frozen before the pool changes
        if preallocate:
            self.curr_region_bytes = round_bytes(limit)
            if not self._extend(MIN_ALLOCATION):
                raise OutOfMemory(
                    f"{self.name}: the device cannot supply even {MIN_ALLOCATION} bytes to preallocate",
                    requested=0, rounded=0, in_use=0, pool_bytes=0, limit=limit,
                    largest_free_block=0, fragmentation=False, bins=[], occupancy="")
        else:
            self.curr_region_bytes = round_bytes(min(limit, INITIAL_REGION))

    # ---- the ordered set of free chunks ---------------------------------------------------
    def _insert(self, key: int) -> None:
        flat = self._flat
        if flat is not None:
            insort(flat, key)
            if len(flat) > 2 * _LOAD:
                self._unflatten()
            return
        maxes = self._maxes
        pos = bisect_left(maxes, key)
        if pos == len(maxes):
            if not maxes:
                self._lists.append([key])
                maxes.append(key)
                return
            pos -= 1
            sub = self._lists[pos]
            sub.append(key)
            maxes[pos] = key
        else:
            sub = self._lists[pos]
            insort(sub, key)
        if len(sub) > 2 * _LOAD:
            self._split_sublist(pos)

    def _unflatten(self) -> None:
        """The flat list has grown past 2 x _LOAD keys: cut it into sublists of _LOAD."""
        flat = self._flat
        assert flat is not None
        self._lists = [flat[j:j + _LOAD] for j in range(0, len(flat), _LOAD)]
        self._maxes = [sub[-1] for sub in self._lists]
        self._flat = None

    def _drop_sublist(self, pos: int) -> None:
        """Sublist `pos` is empty: remove it; with one sublist (or none) left, go flat again."""
        del self._lists[pos]
        del self._maxes[pos]
        if len(self._lists) <= 1:
            self._flat = self._lists.pop() if self._lists else []
            self._maxes = []

    def _split_sublist(self, pos: int) -> None:
        sub = self._lists[pos]
        half = sub[_LOAD:]
        del sub[_LOAD:]
        self._maxes[pos] = sub[-1]
        self._lists.insert(pos + 1, half)
        self._maxes.insert(pos + 1, half[-1])

    def _remove(self, key: int) -> None:
        flat = self._flat
        if flat is not None:
            del flat[bisect_left(flat, key)]
            return
        pos = bisect_left(self._maxes, key)
        sub = self._lists[pos]
        self._delete_slot(sub, bisect_left(sub, key), pos)

    def _delete_slot(self, sub: list[int], i: int, pos: int) -> None:
        """Delete slot i of `sub`, the flat list (pos -1) or sublist `pos`, keeping the maxima."""
        del sub[i]
        if pos < 0:
            pass
        elif not sub:
            self._drop_sublist(pos)
        elif i == len(sub):
            self._maxes[pos] = sub[-1]

    def _merge_freed(self) -> None:
        """Merge the chunks freed since the free set was last read into it: one by one after a
        few frees, or by rebuilding the free set after a long run of them."""
        freed = self._freed
        self._freed = []
        if len(freed) // 2 > len(self._free_start) // 4 + 32:
            self._rebuild_free_set(freed)
            return
        free_start, free_end = self._free_start, self._free_end
        for j in range(0, len(freed), 2):
            address, size = freed[j], freed[j + 1]
            end = address + size
            after = free_start.pop(end, None)
            if after is not None:          # merge with the free chunk that follows
                self._remove(after << _SHIFT | end)
                end += after
            before = free_end.pop(address, None)
            if before is not None:         # ... and with the one that precedes
                self._remove(free_start[before] << _SHIFT | before)
                address = before
            self._put_free(address, end - address)

    def _rebuild_free_set(self, freed: list[int]) -> None:
        """The free chunks and the `freed` ones (address, size pairs), merged where they touch,
        as new tables and a new sorted set. Vectorized: after a drain there are tens of
        thousands of chunks to sort and merge, and a Python loop over them cost more than the
        frees saved."""
        chunks = np.array(freed, dtype=np.int64).reshape(-1, 2)
        if self._free_start:
            old = np.fromiter(self._free_start.items(), dtype=np.dtype((np.int64, 2)), count=len(self._free_start))
            chunks = np.concatenate([chunks, old])
        chunks = chunks[np.argsort(chunks[:, 0])]
        starts, sizes = chunks[:, 0], chunks[:, 1]
        runs = np.flatnonzero(np.concatenate([[True], starts[1:] != starts[:-1] + sizes[:-1]]))
        starts = starts[runs].tolist()
        sizes = np.add.reduceat(sizes, runs).tolist()
        self._free_start = dict(zip(starts, sizes))
        self._free_end = {address + size: address for address, size in zip(starts, sizes)}
        self._flat = sorted([size << _SHIFT | address for address, size in zip(starts, sizes)])
        self._lists, self._maxes = [], []
        if len(self._flat) > 2 * _LOAD:
            self._unflatten()

    def _take_free(self, address: int, size: int) -> None:
        """Take the free chunk [address, +size) out of the free set (it becomes used or goes)."""
        self._remove(size << _SHIFT | address)
        del self._free_start[address]
        del self._free_end[address + size]

    def _put_free(self, address: int, size: int) -> None:
        """Record [address, +size) as a free chunk (its neighbours must not be free)."""
        self._free_start[address] = size
        self._free_end[address + size] = address
        self._insert(size << _SHIFT | address)

    def __init_subclass__(cls, **kwargs: object) -> None:
        # A subclass that changes the allocate hook keeps it called: the fused public allocate
        # below bypasses the hook, so such a subclass gets the base class's generic one.
        super().__init_subclass__(**kwargs)
        if cls._allocate is not BFCAllocator._allocate and cls.allocate is BFCAllocator.allocate:
            cls.allocate = Allocator.allocate  # type: ignore[method-assign]
            cls.free = Allocator.free          # type: ignore[method-assign]  # the matching hook pair

    # ---- the public allocate, fused with the policy's common path -------------------------
    def allocate(self, size: int, *, alignment: int = 256, stream: int = 0) -> Buffer:
        """`Allocator.allocate`, with the common case (a plain request that a free chunk holds)
        written out here, because the hook call, its tuple and `Buffer.__init__` are a
        measurable share of a pair (benchmarks/results/runtime.md). The rest (bad arguments,
        alignment, growth, an error to freeze first) goes the generic way, through `_allocate`."""
        if type(size) is not int or size <= 0 or alignment != 256 or self._oom.pending:
            return self._allocate_generic(size, alignment, stream)
        rounded = (size + 255) & -256
        key = rounded << 48
        sub = self._flat
        if sub is not None:                # few free chunks: one sorted list
            pos = -1
            i = bisect_left(sub, key)
            if i == len(sub):              # no free chunk is large enough: grow, or fail
                # (a test, not a caught IndexError: RMM's recipe fails a third of its
                # allocations on the larger sizes, and raising that error cost more)
                if not self._extend(rounded):
                    raise self._out_of_memory(size, rounded)
                return self._allocate_generic(size, alignment, stream)
            found = sub[i]
        else:
            if self._freed:                # chunks freed since the set was read: merge them first
                self._merge_freed()
                return self.allocate(size, alignment=alignment, stream=stream)
            maxes = self._maxes
            pos = bisect_left(maxes, key)
            if pos == len(maxes):          # no free chunk is large enough: grow, or fail
                if not self._extend(rounded):
                    raise self._out_of_memory(size, rounded)
                return self._allocate_generic(size, alignment, stream)
            sub = self._lists[pos]
            i = bisect_left(sub, key)
            found = sub[i]
        rest = (found >> 48) - rounded
        address = found & 0xFFFFFFFFFFFF
        free_start = self._free_start
        # The same steps as `_allocate`.
        if rest >= rounded:                # split: the tail's key takes the chunk's slot
            tail = address + rounded
            new = rest << 48 | tail
            sub[i] = new
            if pos >= 0 and found == maxes[pos]:
                maxes[pos] = new
            del free_start[address]
            free_start[tail] = rest
            self._free_end[tail + rest] = tail
        elif rest >= 134217728:            # split for the 128 MiB rule
            self._split_by_size_rule(sub, i, pos, found, rounded, rest)
        else:                              # the whole chunk
            del sub[i]
            if pos < 0:
                pass
            elif not sub:
                self._drop_sublist(pos)
            elif i == len(sub):
                maxes[pos] = sub[-1]
            rounded += rest
            del free_start[address]
            del self._free_end[address + rounded]
        # The statistics, as `Allocator.allocate` keeps them.
        self.num_allocs += 1
        in_use = self.bytes_in_use + rounded
        self.bytes_in_use = in_use
        if in_use > self.peak_bytes_in_use:
            self.peak_bytes_in_use = in_use
        if rounded > self.largest_alloc_size:
            self.largest_alloc_size = rounded
        buf = _new(Buffer)                 # the fields of Buffer.__init__, in its order
        buf.address = address
        buf.size = rounded
        buf.requested_size = size
        buf.stream = stream
        buf.owner = self
        buf.live = True
        buf.handle = None
        issued = self._issued
        issued.append(buf)
        if len(issued) > self._sweep_at:
            self._sweep_issued()
        return buf

    def _allocate_generic(self, size: int, alignment: int, stream: int) -> Buffer:
        """`Allocator.allocate` through the hooks; the buffer is then listed as the fast path's are."""
        buf = Allocator.allocate(self, size, alignment=alignment, stream=stream)
        del self._used[buf.address]
        self._issued.append(buf)
        return buf

    def free(self, buffer: Buffer) -> None:
        """`Allocator.free` for buffers of the public allocate, which are listed in `_issued`
        (freed ones are swept out later) rather than in the table of used chunks."""
        if type(buffer) is not Buffer or buffer.owner is not self or not buffer.live:
            self._check_free(buffer)
        size = buffer.size
        self.bytes_in_use -= size
        self._release(buffer.address, size)
        buffer.live = False            # after: an error frozen on the way still sees it in use

    def _sweep_issued(self) -> None:
        # Amortized: a sweep keeps the live half at most, so it runs once per as many allocations.
        self._issued = [buf for buf in self._issued if buf.live]
        self._sweep_at = 2 * len(self._issued) + _MIN_SWEEP

    # ---- hooks ------------------------------------------------------------------------------
    # The two hot hooks are written flat: constants inline (48 = _SHIFT, 0xFFFFFFFFFFFF = _MASK,
    # 134217728 = MAX_INTERNAL_FRAGMENTATION), no helper calls on the common path.
    def _allocate(self, size: int, alignment: int, stream: int) -> tuple[int, int, object]:
        if self._oom.pending:
            self._oom.settle()
        if self._freed:
            self._merge_freed()
        rounded = (size + 255) & -256
        if alignment > 256:
            return self._allocate_aligned(size, rounded, alignment)
        key = rounded << 48
        sub = self._flat
        if sub is not None:
            pos = -1
            i = bisect_left(sub, key)
            if i == len(sub):              # no free chunk is large enough
                return self._allocate_after_extending(size, rounded, stream)
        else:
            maxes = self._maxes
            pos = bisect_left(maxes, key)
            try:
                sub = self._lists[pos]
            except IndexError:             # no free chunk is large enough
                return self._allocate_after_extending(size, rounded, stream)
            i = bisect_left(sub, key)
        found = sub[i]
        address = found & 0xFFFFFFFFFFFF
        rest = (found >> 48) - rounded
        free_start = self._free_start
        if rest >= rounded:
            # Split. The tail's key is at least `key` (rest >= rounded), so above every key
            # before slot i, and below `found`: it takes the chunk's slot.
            tail = address + rounded
            new = rest << 48 | tail
            sub[i] = new
            if pos >= 0 and found == maxes[pos]:
                maxes[pos] = new
            del free_start[address]
            free_start[tail] = rest
            self._free_end[tail + rest] = tail
        elif rest >= 134217728:
            self._split_by_size_rule(sub, i, pos, found, rounded, rest)
        else:
            self._delete_slot(sub, i, pos)
            rounded += rest
            del free_start[address]
            del self._free_end[address + rounded]
        self._used[address] = rounded
        return address, rounded, None

    def _split_by_size_rule(self, sub: list[int], i: int, pos: int, found: int, rounded: int, rest: int) -> None:
        """Split free chunk `found` (slot i of `sub`, sublist `pos` or -1 when flat) although the
        leftover `rest` is smaller than the request: the 128 MiB rule. The leftover's key may sort
        before earlier keys, so it takes the chunk's slot only when it still sorts there."""
        address = found & _MASK
        tail = address + rounded
        new = rest << _SHIFT | tail
        maxes = self._maxes
        if (sub[i - 1] < new) if i else (pos <= 0 or maxes[pos - 1] < new):
            sub[i] = new
            if pos >= 0 and found == maxes[pos]:
                maxes[pos] = new
        else:
            self._delete_slot(sub, i, pos)
            self._insert(new)
        del self._free_start[address]
        self._free_start[tail] = rest
        self._free_end[tail + rest] = tail

    def _allocate_after_extending(self, size: int, rounded: int, stream: int) -> tuple[int, int, object]:
        if not self._extend(rounded):
            raise self._out_of_memory(size, rounded)
        return self._allocate(size, MIN_ALLOCATION, stream)  # a chunk that fits exists now

    def _allocate_aligned(self, size: int, rounded: int, alignment: int) -> tuple[int, int, object]:
        """Slow path for alignment above 256: smallest free chunk that holds an aligned block."""
        found = self._find_aligned(rounded, alignment)
        if found is None:
            # A region this large holds an aligned block wherever the device puts it.
            if not self._extend(rounded + alignment - MIN_ALLOCATION):
                raise self._out_of_memory(size, rounded)
            found = self._find_aligned(rounded, alignment)
            assert found is not None
        start, chunk = found
        aligned = -(-start // alignment) * alignment
        self._take_free(start, chunk)
        if aligned > start:  # the unaligned front stays a free chunk of its own
            self._put_free(start, aligned - start)
            chunk -= aligned - start
        rest = chunk - rounded
        if rest >= rounded or rest >= MAX_INTERNAL_FRAGMENTATION:
            self._put_free(aligned + rounded, rest)
        else:
            rounded = chunk
        self._used[aligned] = rounded
        return aligned, rounded, None

    def _find_aligned(self, rounded: int, alignment: int) -> tuple[int, int] | None:
        key = rounded << _SHIFT
        if self._flat is not None:
            subs = [self._flat]
        else:
            subs = self._lists[bisect_left(self._maxes, key):]
        for sub in subs:
            for found in sub[bisect_left(sub, key):]:
                start, chunk = found & _MASK, found >> _SHIFT
                if -(-start // alignment) * alignment + rounded <= start + chunk:
                    return start, chunk
            key = 0
        return None

    def _free(self, address: int, size: int, handle: object, stream: int) -> None:
        del self._used[address]
        self._release(address, size)

    def _release(self, address: int, size: int) -> None:
        """The chunk [address, +size) is free again: merge it with free neighbours."""
        if self._oom.pending:
            self._oom.settle()
        if self._flat is None:
            # Many free chunks (a pool being drained, say): only note the chunk. The next reader
            # of the free set merges the notes in, one by one or by a rebuild after a long run
            # (glibc's unsorted bin does the same), so a run of frees costs no edits at all.
            freed = self._freed
            freed.append(address)
            freed.append(size)
            return
        free_start = self._free_start
        free_end = self._free_end
        end = address + size
        if end in free_start:              # merge with the free chunk that follows
            after = free_start.pop(end)
            old = after << 48 | end        # its key, whose slot the merged chunk may take
            end += after
            if address in free_end:        # ... and with the one that precedes
                before = free_end.pop(address)
                self._remove(old)
                old = free_start[before] << 48 | before
                address = before
        elif address in free_end:          # merge with the free chunk that precedes
            before = free_end.pop(address)
            old = free_start[before] << 48 | before
            address = before
        else:                              # no free neighbour: a new key
            free_start[address] = size
            free_end[end] = address
            sub = self._flat
            insort(sub, size << 48 | address)
            if len(sub) > 512:             # 2 x _LOAD
                self._unflatten()
            return
        size = end - address
        free_start[address] = size
        free_end[end] = address
        new = size << 48 | address
        # The merged key is bigger than the neighbour's; if nothing lies between them it
        # takes the neighbour's slot and the list needs no reshuffle.
        sub = self._flat
        i = bisect_left(sub, old)
        if i + 1 == len(sub) or sub[i + 1] > new:
            sub[i] = new
        else:
            del sub[i]
            insort(sub, new)

    def _pool_bytes(self) -> int:
        return self.pool_bytes

    def _largest_free_block(self) -> int:
        if self._freed:
            self._merge_freed()
        flat = self._flat
        if flat is not None:
            return flat[-1] >> _SHIFT if flat else 0
        return self._maxes[-1] >> _SHIFT

    def _chunks(self) -> Iterator[Chunk]:
        if self._freed:
            self._merge_freed()
        used = {buf.address: buf.size for buf in self._issued if buf.live}
        used.update(self._used)
        return _walk(sorted(self._regions.items()), used, self._free_start)

    def _empty_cache(self) -> int:
        """Return every wholly free region to the backend (growth mode; a preallocated pool
        keeps its one region, as JAX does)."""
        if self.preallocate:
            return 0
        if self._oom.pending:
            self._oom.settle()
        if self._freed:
            self._merge_freed()
        released = 0
        for start, end in list(self._regions.items()):
            if self._free_start.get(start) != end - start:   # not one free chunk over the region
                continue
            self._take_free(start, end - start)
            for address, _ in self._parts.pop(start):
                self.backend.release(address)
                self.device_frees += 1
            del self._regions[start]
            del self._region_end[end]
            released += end - start
        self.pool_bytes -= released
        return released

    # ---- growth -------------------------------------------------------------------------------
    def _extend(self, rounded: int) -> bool:
        """Add a region of at least `rounded` bytes, as BFCAllocator::Extend does; False if
        neither the limit nor the device allows one. On False nothing has changed."""
        available = (self.limit - self.pool_bytes) // MIN_ALLOCATION * MIN_ALLOCATION
        if rounded > available:
            return False
        region = self.curr_region_bytes
        increased = False
        while rounded > region:
            region *= 2
            increased = True
        nbytes = min(region, available)
        address = self.backend.reserve(nbytes)
        while address is None:
            nbytes = round_bytes(int(nbytes * BACKPEDAL))
            if nbytes < rounded:
                return False
            address = self.backend.reserve(nbytes)
        # The next region doubles, unless this one already had to grow to fit the request.
        self.curr_region_bytes = region if increased else region * 2
        self.device_allocs += 1
        self.device_alloc_bytes += nbytes
        self.pool_bytes += nbytes
        if self.pool_bytes > self.peak_pool_bytes:
            self.peak_pool_bytes = self.pool_bytes
        self._add_region(address, nbytes)
        return True

    def _add_region(self, address: int, nbytes: int) -> None:
        start, end = address, address + nbytes
        parts = [(address, nbytes)]
        before = self._region_end.pop(start, None)
        if before is not None:          # the device placed it right after another region
            del self._regions[before]
            parts = self._parts.pop(before) + parts
            start = before
        after = self._regions.pop(end, None)
        if after is not None:           # ... or right before one
            del self._region_end[after]
            parts += self._parts.pop(end)
            end = after
        self._regions[start] = end
        self._region_end[end] = start
        self._parts[start] = parts
        # The new bytes are a free chunk that merges with free chunks at the seams.
        self._used[address] = nbytes
        self._free(address, nbytes, None, 0)

    # ---- out of memory ------------------------------------------------------------------------
    def regions(self) -> list[tuple[int, int]]:
        """(start, end) of each region, address order."""
        return sorted(self._regions.items())

    def _out_of_memory(self, size: int, rounded: int) -> OutOfMemory:
        pool_bytes, in_use = self.pool_bytes, self.bytes_in_use
        err = BFCOutOfMemory.taken(
            self.name, self._chunk_list,
            (size, rounded, in_use, pool_bytes, self.limit, self._largest_free_block(),
             pool_bytes - in_use >= rounded))
        self._oom.pending = _weakref(err)   # OomWatch.track, inline: failures are frequent
        return err

    def _chunk_list(self) -> list[Chunk]:
        return list(self._chunks())


def oom_message(name: str, requested: int, rounded: int, in_use: int, pool_bytes: int, limit: int,
                largest_free_block: int) -> str:
    """The message of a BFC out-of-memory error: what was asked, the pool, and the cause.

    >>> oom_message("bfc", 1000, 1024, 0, 512, 512, 512).split(";")[0]
    'bfc ran out of memory trying to allocate 1000 B (1000 bytes, rounded to 1024)'
    """
    free_total = pool_bytes - in_use
    if free_total >= rounded:
        cause = (f"; cause: fragmentation ({format_size(free_total)} free in the pool, but no "
                 f"free block that large)")
    elif pool_bytes + rounded <= limit:
        cause = "; cause: the device could not supply a new region under the limit"
    else:
        cause = ""
    return (
        f"{name} ran out of memory trying to allocate {format_size(requested)} ({requested} bytes, "
        f"rounded to {rounded}); in use {format_size(in_use)}, pool "
        f"{format_size(pool_bytes)} of limit {format_size(limit)}, largest free "
        f"block {format_size(largest_free_block)}{cause}")


_DETAILS = ("requested", "rounded", "in_use", "pool_bytes", "limit", "largest_free_block", "fragmentation")
_new_error = BaseException.__new__


class BFCOutOfMemory(PoolOutOfMemory):
    """The BFC pool's `PoolOutOfMemory`, whose message is written when first read.

    RMM's benchmark recipe fails thousands of times and reads no message; formatting six sizes
    was most of the cost of a failure, and filling in the attributes most of the rest. The
    numbers are taken when the allocation failed, so the text is the same whenever it is read.
    `str`, `repr` and `args` all see the written message; the first read of any attribute
    (`requested`, `details`, ...) fills them all in, as `PoolOutOfMemory`'s constructor would.
    """

    def __init__(self, pool_name: str, chunks_now, **details: object) -> None:
        # What PoolOutOfMemory.__init__ and OutOfMemory.__init__ leave behind, set in one go:
        # their chain of calls and per-detail setattr were half the cost of a failure. A test
        # (tests/runtime/test_runtime_bfc_fastpath.py) checks the result equals theirs.
        self.details = details
        self.__dict__.update(details)
        self._chunks_now = chunks_now
        self._chunks = None
        self._pool_name: str | None = pool_name

    @classmethod
    def taken(cls, pool_name: str, chunks_now, numbers: tuple) -> "BFCOutOfMemory":
        """The error for numbers taken at the failure (in the order of `_DETAILS`), with its
        attributes filled in on first read: the pool's failure path only stores the tuple."""
        err = _new_error(cls)
        err._taken = (pool_name, chunks_now, numbers)
        return err

    def __getattr__(self, name: str):
        # Called only when an attribute is missing: fill in what `taken` deferred, then retry.
        taken = self.__dict__.pop("_taken", None)
        if taken is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        pool_name, chunks_now, numbers = taken
        details = dict(zip(_DETAILS, numbers))
        state = self.__dict__
        state["details"] = details
        state.update(details)
        state["_chunks_now"] = chunks_now
        state["_chunks"] = None
        state["_pool_name"] = pool_name
        return getattr(self, name)

    def _write(self) -> None:
        if self._pool_name is not None:
            d = self.details
            message = oom_message(self._pool_name, d["requested"], d["rounded"], d["in_use"],
                                  d["pool_bytes"], d["limit"], d["largest_free_block"])
            self._pool_name = None
            BaseException.args.__set__(self, (message,))

    @property  # type: ignore[override]
    def args(self) -> tuple:
        self._write()
        return BaseException.args.__get__(self)

    @args.setter
    def args(self, value: tuple) -> None:
        self._pool_name = None
        BaseException.args.__set__(self, value)

    def __str__(self) -> str:
        self._write()
        return BaseException.__str__(self)

    def __repr__(self) -> str:
        self._write()
        return BaseException.__repr__(self)

    def __reduce__(self):
        self._write()                    # fills in the attributes too
        return BaseException.__reduce__(self)


def _walk(regions: list[tuple[int, int]], used: dict[int, int], free: dict[int, int]) -> Iterator[Chunk]:
    """Every chunk of the given regions, address order, from the tables of used and free chunks."""
    for index, (start, end) in enumerate(regions):
        address = start
        while address < end:
            size = used.get(address)
            if size is None:
                size = free[address]
                yield Chunk(address, size, False, index)
            else:
                yield Chunk(address, size, True, index)
            address += size
