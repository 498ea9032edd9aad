"""A model of PyTorch's CUDA caching allocator (the native backend of CUDACachingAllocator.cpp).

It follows the real allocator's decisions step by step, so that replaying a recorded stream of
allocations and frees reproduces the recorded `cudaMalloc`s:

- sizes round up to 512 bytes (or a power-of-two division, `roundup_power2_divisions`);
- requests up to 1 MiB use the small pool, larger ones the large pool; the pools never share
  a segment;
- a request that finds no cached block makes a segment of 2 MiB (small), 20 MiB (requests under
  10 MiB) or the request rounded up to 2 MiB;
- best fit per stream: the free block of the smallest size, then the lowest address;
- a found block is split when the rest is at least 512 bytes (small pool, expandable segments)
  or more than 1 MiB (large pool, requests under `max_split_size`);
- blocks of `max_split_size` or more are never split and serve only requests within
  `max_non_split_rounding_size` (20 MiB) of their size;
- when the device refuses a segment: free oversize cached blocks, then every whole cached
  segment, then retry; the `garbage_collection_threshold` frees blocks unused for longest first;
- expandable segments map 2 MiB (small) or 20 MiB (large) pages into one reserved address range
  per pool and stream, at the lowest address that fits.

    backend = SimulatedBackend("80GiB")
    alloc = make_caching_allocator(backend, limit=backend.capacity)
    buf = alloc.allocate(3 << 20)       # first segment: 20 MiB, the block is 3 MiB
    alloc.free(buf)                     # cached, not returned: alloc.device_frees == 0

The `limit` plays the part of `torch.cuda.set_per_process_memory_fraction`: a segment that would
take the reserved total past it is refused like a failed cudaMalloc. As in PyTorch, running out
of memory first empties the cache, so after an OutOfMemory the pool holds fewer cached bytes.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any, Iterator

from jaxmem.errors import AllocationError, ConfigError, OutOfMemory
from jaxmem.runtime.allocator import Allocator, Backend, Chunk, ReplayPair
from jaxmem.runtime.caching_config import (
    K_LARGE_BUFFER, K_MIN_BLOCK_SIZE, K_SMALL_BUFFER, K_SMALL_SIZE, NO_LIMIT, CachingConfig,
    allocation_size, config_from_settings, parse_alloc_conf, round_size,
)

SMALL, LARGE = 0, 1
_SHIFT = 64                       # free-list key: size << 64 | address (sorts like (size, ptr))
_MASK = (1 << _SHIFT) - 1
_VIRTUAL_BASE = 1 << 56           # expandable segments' reserved address ranges start here


class _Block:
    """A piece of a segment: allocated, cached free, or (expandable) unmapped address space."""

    __slots__ = ("addr", "size", "stream", "pool", "prev", "next", "allocated", "mapped",
                 "seg", "requested", "gc_base")

    def __init__(self, addr: int, size: int, stream: int, pool: int, seg: "_Segment") -> None:
        self.addr = addr
        self.size = size
        self.stream = stream
        self.pool = pool
        self.prev: _Block | None = None
        self.next: _Block | None = None
        self.allocated = False
        self.mapped = True
        self.seg = seg
        self.requested = 0
        self.gc_base = 0


class _Segment:
    """One cudaMalloc (or one reserved range of an expandable segment)."""

    __slots__ = ("addr", "size", "pool", "stream", "expandable", "pages", "index", "ref")

    def __init__(self, addr: int, size: int, pool: int, stream: int, expandable: bool, index: int) -> None:
        self.addr = addr
        self.size = size
        self.pool = pool
        self.stream = stream
        self.expandable = expandable
        self.pages: dict[int, int] = {}   # page number -> backend address of its physical memory
        self.index = index
        self.ref: _Block | None = None    # some live block of the segment (walk prev to its head)

    def blocks(self) -> Iterator["_Block"]:
        """Its blocks in address order."""
        b = self.ref
        while b is not None and b.prev is not None:
            b = b.prev
        while b is not None:
            yield b
            b = b.next


class CachingAllocator(Allocator):
    """PyTorch's caching allocator, modelled; see the module docstring for the rules.

    >>> from jaxmem.runtime.backends import SimulatedBackend
    >>> alloc = CachingAllocator(SimulatedBackend("1GiB"), limit=1 << 30)
    >>> b = alloc.allocate(1000); (b.size, alloc.memory_stats()["pool_bytes"])
    (1024, 2097152)

    Args:
        backend: where segments (cudaMalloc) and expandable pages come from.
        limit: most bytes the allocator may reserve (a failed cudaMalloc past it).
        config: a CachingConfig; or give `alloc_conf` (a PYTORCH_CUDA_ALLOC_CONF string) or
            `settings` (a snapshot's `allocator_settings`).
        expandable: force expandable segments on (True) or off (False); None keeps the config's.
    """

    name = "caching"

    def __init__(self, backend: Backend, limit: int, config: CachingConfig | None = None,
                 *, expandable: bool | None = None) -> None:
        super().__init__(backend, limit)
        cfg = config or CachingConfig()
        if expandable is not None:
            cfg = CachingConfig(cfg.max_split_size, cfg.max_non_split_rounding_size,
                                list(cfg.roundup_power2_divisions), cfg.garbage_collection_threshold,
                                bool(expandable))
        self.config = cfg
        self.name = "caching-expandable" if cfg.expandable_segments else "caching"
        self._expandable = cfg.expandable_segments
        self._max_split = cfg.max_split_size
        self._max_round = cfg.max_non_split_rounding_size
        self._plain_round = not any(cfg.roundup_power2_divisions)
        self._gc = cfg.garbage_collection_threshold > 0.0
        self._fast = not (self._gc or self._expandable or self._max_split != NO_LIMIT)  # malloc's inline path
        # per pool: stream -> sorted keys (size << 64 | addr) of mapped free blocks
        self._freelists: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})
        self._free_block: dict[int, _Block] = {}     # addr -> mapped free block
        # expandable only: per pool, stream -> sorted addresses of unmapped blocks
        self._unmapped: tuple[dict[int, list[int]], dict[int, list[int]]] = ({}, {})
        self._unmapped_block: dict[int, _Block] = {}
        self._segments: dict[int, _Segment] = {}     # segment addr -> segment
        self._next_index = 0
        self._next_virtual = _VIRTUAL_BASE
        self._gc_calls = [0, 0]
        self.reserved_bytes = 0                      # PyTorch's total_allocated_memory
        self.num_alloc_retries = 0
        self.num_ooms = 0

    # ---- the hooks -----------------------------------------------------------------------
    def _allocate(self, size: int, alignment: int, stream: int) -> tuple[int, int, object]:
        block = self.malloc(size, stream) if alignment <= K_MIN_BLOCK_SIZE else self._malloc_aligned(size, alignment, stream)
        return block.addr, block.size, block

    def _malloc_aligned(self, size: int, alignment: int, stream: int) -> _Block:
        """An alignment PyTorch never asks for (its blocks are 512-aligned): take a block with
        room for it and give the bytes in front of the aligned address back to the cache."""
        block = self.malloc(size + alignment, stream)
        aligned = -(-block.addr // alignment) * alignment
        front = aligned - block.addr
        if front:
            # the block's neighbours are never free (free neighbours are always merged), so the
            # front piece stands alone
            piece = _Block(block.addr, front, block.stream, block.pool, block.seg)
            piece.prev, piece.next = block.prev, block
            if block.prev is not None:
                block.prev.next = piece
            block.prev = piece
            block.addr, block.size = aligned, block.size - front
            self._insert_free(piece)
        block.requested = size
        return block

    def _free(self, address: int, size: int, handle: object, stream: int) -> None:
        self.free_block(handle)  # type: ignore[arg-type]

    adopts_segments = True

    def replay_pair(self) -> ReplayPair:
        """malloc(size, stream) -> block and free_block(block): one call each, no tuples."""
        return ReplayPair(self.malloc, self.free_block, True)

    def _pool_bytes(self) -> int:
        return self.reserved_bytes

    def _largest_free_block(self) -> int:
        best = 0
        for pool in self._freelists:
            for keys in pool.values():
                if keys and keys[-1] >> _SHIFT > best:
                    best = keys[-1] >> _SHIFT
        return best

    def _empty_cache(self) -> int:
        before = self.reserved_bytes
        self.release_cached_blocks()
        return before - self.reserved_bytes

    def _chunks(self) -> Iterator[Chunk]:
        for seg in sorted(self._segments.values(), key=lambda s: s.addr):
            for b in seg.blocks():
                if b.mapped:
                    yield Chunk(b.addr, b.size, b.allocated, seg.index)

    # ---- malloc ----------------------------------------------------------------------------
    def malloc(self, orig_size: int, stream: int = 0) -> _Block:
        """Allocate `orig_size` bytes on `stream`; returns the block (raises OutOfMemory)."""
        if self._plain_round:
            size = K_MIN_BLOCK_SIZE if orig_size < K_MIN_BLOCK_SIZE else -(-orig_size // K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
        else:
            size = round_size(orig_size, self.config)
        pool = SMALL if size <= K_SMALL_SIZE else LARGE
        # the common case inline: a non-expandable cached block, no max_split_size
        keys = self._freelists[pool].get(stream)
        block = None
        if keys and self._fast:
            i = bisect_left(keys, size << _SHIFT)
            if i < len(keys):
                block = self._free_block.pop(keys.pop(i) & _MASK)
        else:
            block = self._get_free_block(pool, size, stream)
        if block is None:
            block = self._malloc_slow(pool, size, stream, orig_size)
        remaining = block.size - size
        if pool == SMALL or self._expandable:
            split = remaining >= K_MIN_BLOCK_SIZE
        else:
            split = size < self._max_split and remaining > K_SMALL_SIZE
        if split:
            # the allocated part keeps the front; the free rest stays cached behind it
            rest = block
            block = _Block(rest.addr, size, stream, pool, rest.seg)
            prev = rest.prev
            block.prev = prev
            if prev is not None:
                prev.next = block
            block.next = rest
            rest.prev = block
            rest.addr += size
            rest.size = remaining
            rest.gc_base = self._gc_calls[pool]
            keys = self._freelists[pool].get(stream)
            if keys is None:
                keys = self._freelists[pool][stream] = []
            insort(keys, (remaining << _SHIFT) | rest.addr)
            self._free_block[rest.addr] = rest
        block.allocated = True
        block.requested = orig_size
        return block

    def _get_free_block(self, pool: int, size: int, stream: int) -> _Block | None:
        if self._gc:
            self._gc_calls[pool] += 1
        keys = self._freelists[pool].get(stream)
        if not keys:
            return None
        i = bisect_left(keys, size << _SHIFT)
        if i == len(keys):
            return None
        key = keys[i]
        found = self._free_block[key & _MASK]
        if found.seg.expandable:
            # best fit counts the unmapped space behind a block as part of it
            best = found.size + (found.next.size if found.next is not None and not found.next.mapped else 0)
            j = i + 1
            while j < len(keys):
                nxt = self._free_block[keys[j] & _MASK]
                if not nxt.seg.expandable:
                    break
                nsize = nxt.size + (nxt.next.size if nxt.next is not None and not nxt.next.mapped else 0)
                if nsize >= best:
                    break
                i, key, found, best = j, keys[j], nxt, nsize
                j += 1
        bsize = key >> _SHIFT
        if size < self._max_split and bsize >= self._max_split:
            return None   # do not hand an oversize block to a request that could split
        if size >= self._max_split and bsize >= size + self._max_round:
            return None   # oversize blocks serve only requests close to their size
        del keys[i]
        del self._free_block[found.addr]
        return found

    def _malloc_slow(self, pool: int, size: int, stream: int, orig_size: int) -> _Block:
        if self._gc:
            self._garbage_collect()
        block = self._alloc_block(pool, size, stream)
        if block is None and self._release_available_cached_blocks(pool, size, stream):
            block = self._alloc_block(pool, size, stream)
        if block is None:
            self.release_cached_blocks()
            self.num_alloc_retries += 1
            block = self._alloc_block(pool, size, stream)
        if block is None:
            self.num_ooms += 1
            self._raise_oom(orig_size, size)
        return block  # type: ignore[return-value]

    def _raise_oom(self, orig_size: int, size: int) -> None:
        from jaxmem.runtime.dump import PoolOutOfMemory

        free = self.reserved_bytes - self.bytes_in_use
        largest = self._largest_free_block()
        chunks = list(self._chunks())   # the pool as it was when it failed: bins/occupancy built on read
        raise PoolOutOfMemory(
            f"caching allocator out of memory: tried to allocate {allocation_size(size)} bytes for a "
            f"{orig_size}-byte request; {self.bytes_in_use} in use, {self.reserved_bytes} reserved, limit {self.limit}",
            lambda: chunks, requested=orig_size, rounded=size, in_use=self.bytes_in_use, pool_bytes=self.reserved_bytes,
            limit=self.limit, largest_free_block=largest, fragmentation=free >= size)

    def _count_device_alloc(self, nbytes: int) -> None:
        """The statistics of `nbytes` newly reserved (or mapped) from the device."""
        self.reserved_bytes += nbytes
        if self.reserved_bytes > self.peak_pool_bytes:
            self.peak_pool_bytes = self.reserved_bytes
        self.device_allocs += 1
        self.device_alloc_bytes += nbytes

    def _alloc_block(self, pool: int, size: int, stream: int) -> _Block | None:
        alloc_size = allocation_size(size)
        if self.reserved_bytes + alloc_size > self.limit:
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, size, stream)
        addr = self.backend.reserve(alloc_size)
        if addr is None:
            return None
        seg = _Segment(addr, alloc_size, pool, stream, False, self._next_index)
        self._next_index += 1
        self._segments[addr] = seg
        block = _Block(addr, alloc_size, stream, pool, seg)
        seg.ref = block
        self._count_device_alloc(alloc_size)
        return block

    # ---- free ------------------------------------------------------------------------------
    def free_block(self, block: _Block) -> None:
        """Return an allocated block to the cache, merging it with free neighbours."""
        block.allocated = False
        block.requested = 0
        prev = block.prev
        if prev is not None and not prev.allocated and prev.mapped == block.mapped:
            self._merge(block, prev)
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.mapped == block.mapped:
            self._merge(block, nxt)
        pool = block.pool
        block.gc_base = self._gc_calls[pool]
        keys = self._freelists[pool].get(block.stream)
        if keys is None:
            keys = self._freelists[pool][block.stream] = []
        insort(keys, (block.size << _SHIFT) | block.addr)
        self._free_block[block.addr] = block

    def _insert_free(self, block: _Block) -> None:
        block.gc_base = self._gc_calls[block.pool]
        keys = self._freelists[block.pool].get(block.stream)
        if keys is None:
            keys = self._freelists[block.pool][block.stream] = []
        insort(keys, (block.size << _SHIFT) | block.addr)
        self._free_block[block.addr] = block

    def _remove_free(self, block: _Block) -> None:
        keys = self._freelists[block.pool][block.stream]
        del keys[bisect_left(keys, (block.size << _SHIFT) | block.addr)]
        del self._free_block[block.addr]

    def _merge(self, dst: _Block, src: _Block) -> None:
        """dst absorbs its free neighbour src (both mapped, or both unmapped)."""
        if src.mapped:
            keys = self._freelists[src.pool][src.stream]
            del keys[bisect_left(keys, (src.size << _SHIFT) | src.addr)]
            del self._free_block[src.addr]
        else:
            self._remove_unmapped(src)
        if dst.prev is src:
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size
        if dst.seg.ref is src:
            dst.seg.ref = dst

    # ---- giving memory back ----------------------------------------------------------------
    def _release_block(self, block: _Block) -> None:
        """cudaFree a cached block that is a whole (non-expandable) segment."""
        self._remove_free(block)
        del self._segments[block.addr]
        self.backend.release(block.addr)
        self.reserved_bytes -= block.size
        self.device_frees += 1

    def _release_available_cached_blocks(self, pool: int, size: int, stream: int) -> bool:
        if self._max_split == NO_LIMIT:
            return False
        key_size = max(size, self._max_split)
        keys = self._freelists[pool].get(stream) or []
        # Blocks of expandable segments are never cudaFree'd here: their pages are unmapped only
        # by empty_cache (PyTorch skips them the same way).
        i = bisect_left(keys, key_size << _SHIFT)
        while i < len(keys) and self._free_block[keys[i] & _MASK].seg.expandable:
            i += 1
        if i < len(keys):
            self._release_block(self._free_block[keys[i] & _MASK])
            return True
        # no single block is large enough: free oversize blocks, largest first
        released = 0
        j = len(keys) - 1
        while released < key_size and j >= 0 and keys[j] >> _SHIFT >= self._max_split:
            block = self._free_block[keys[j] & _MASK]
            if not block.seg.expandable:
                released += block.size
                self._release_block(block)
            j -= 1
        return released >= key_size

    def release_segment_at(self, addr: int) -> bool:
        """cudaFree the segment at `addr` if it is wholly cached (replaying a recorded cudaFree)."""
        seg = self._segments.get(addr)
        if seg is None or seg.expandable:
            return False
        head = next(seg.blocks())
        if head.allocated or head.next is not None or head.prev is not None:
            return False
        self._release_block(head)
        return True

    def release_cached_blocks(self) -> None:
        """empty_cache: cudaFree every cached whole segment; unmap free expandable pages."""
        for pool in (LARGE, SMALL):
            for stream in sorted(self._freelists[pool]):
                to_unmap = []
                for key in list(self._freelists[pool][stream]):
                    block = self._free_block.get(key & _MASK)
                    if block is None:
                        continue
                    if block.seg.expandable:
                        to_unmap.append(block)
                    elif block.prev is None and block.next is None:
                        self._release_block(block)
                for block in to_unmap:
                    self._unmap_block(block)
                    if block.prev is None and block.next is None and not block.mapped:
                        self._release_expandable_segment(block)

    def _garbage_collect(self) -> None:
        """Free cached whole large segments unused the longest, down to the threshold."""
        threshold = int(self.config.garbage_collection_threshold * self.limit)
        if self.reserved_bytes <= threshold:
            return
        target = self.reserved_bytes - threshold
        calls = self._gc_calls[LARGE]

        def whole_blocks() -> list[_Block]:
            out = []
            for stream in sorted(self._freelists[LARGE]):
                for key in self._freelists[LARGE][stream]:
                    b = self._free_block[key & _MASK]
                    if b.prev is None and b.next is None and not b.seg.expandable:
                        out.append(b)
            return out

        candidates = whole_blocks()
        if not candidates:
            return
        total_age = sum(calls - b.gc_base for b in candidates)
        count = len(candidates)
        reclaimed, freed = 0, True
        while reclaimed < target and freed and count > 0:
            age_threshold = total_age / count
            freed = False
            for b in whole_blocks():
                age = calls - b.gc_base
                if age >= age_threshold:
                    freed = True
                    reclaimed += b.size
                    total_age -= age
                    count -= 1
                    self._release_block(b)

    # ---- expandable segments ---------------------------------------------------------------
    def _page(self, pool: int) -> int:
        return K_SMALL_BUFFER if pool == SMALL else K_LARGE_BUFFER

    def _insert_unmapped(self, block: _Block) -> None:
        insort(self._unmapped[block.pool].setdefault(block.stream, []), block.addr)
        self._unmapped_block[block.addr] = block

    def _remove_unmapped(self, block: _Block) -> None:
        addrs = self._unmapped[block.pool][block.stream]
        del addrs[bisect_left(addrs, block.addr)]
        del self._unmapped_block[block.addr]

    def _find_expandable_block(self, pool: int, size: int, stream: int) -> _Block:
        def allocatable(b: _Block | None) -> bool:
            return b is not None and not b.allocated

        for addr in self._unmapped[pool].get(stream, ()):
            c = self._unmapped_block[addr]
            if allocatable(c.prev):
                c = c.prev  # type: ignore[assignment]
            b: _Block | None = c
            room = 0
            while room < size and allocatable(b):
                room += b.size  # type: ignore[union-attr]
                b = b.next  # type: ignore[union-attr]
            if room >= size:
                return c
        # a new reserved range: 9/8 of the device, as PyTorch reserves
        page = self._page(pool)
        capacity = getattr(self.backend, "capacity", self.limit)
        span = -(-(capacity + capacity // 8) // page) * page
        seg = _Segment(self._next_virtual, span, pool, stream, True, self._next_index)
        self._next_index += 1
        self._next_virtual += span + page
        self._segments[seg.addr] = seg
        block = _Block(seg.addr, span, stream, pool, seg)
        block.mapped = False
        seg.ref = block
        self._insert_unmapped(block)
        return block

    def _map_block(self, to_map: _Block, size: int) -> bool:
        seg, page = to_map.seg, self._page(to_map.pool)
        begin = (to_map.addr - seg.addr) // page
        end = -(-(to_map.addr + size - seg.addr) // page)
        if self.reserved_bytes + (end - begin) * page > self.limit:
            return False  # mapping counts against the limit as a cudaMalloc does
        taken = []
        for p in range(begin, end):
            phys = self.backend.reserve(page)
            if phys is None:
                for q, addr in taken:
                    self.backend.release(addr)
                    del seg.pages[q]
                return False
            taken.append((p, phys))
            seg.pages[p] = phys
        mapped = (end - begin) * page
        self._remove_unmapped(to_map)
        to_map.mapped = True
        if mapped < to_map.size:
            rest = _Block(to_map.addr + mapped, to_map.size - mapped, to_map.stream, to_map.pool, seg)
            rest.mapped = False
            rest.prev, rest.next = to_map, to_map.next
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            to_map.size = mapped
            self._insert_unmapped(rest)
        prev = to_map.prev
        if prev is not None and not prev.allocated and prev.mapped:
            self._merge(to_map, prev)
        nxt = to_map.next
        if nxt is not None and not nxt.allocated and nxt.mapped:
            self._merge(to_map, nxt)
        self._insert_free(to_map)
        self._count_device_alloc(mapped)
        return True

    def _try_allocate_expandable_block(self, pool: int, size: int, stream: int) -> _Block | None:
        candidate = self._find_expandable_block(pool, size, stream)
        if not candidate.mapped and not self._map_block(candidate, min(candidate.size, size)):
            return None
        while candidate.size < size:
            nxt = candidate.next
            assert nxt is not None and not nxt.mapped, "expandable segment: free block not followed by unmapped space"
            if not self._map_block(nxt, min(size - candidate.size, nxt.size)):
                return None
            candidate = nxt
        self._remove_free(candidate)
        return candidate

    def _unmap_block(self, block: _Block) -> None:
        """Give back the whole pages inside a free mapped block of an expandable segment."""
        seg, page = block.seg, self._page(block.pool)
        begin = -(-(block.addr - seg.addr) // page)
        end = (block.addr + block.size - seg.addr) // page
        if begin >= end:
            return
        self._remove_free(block)
        start, stop = seg.addr + begin * page, seg.addr + end * page
        old, old_end = block.addr, block.addr + block.size
        if start > old:
            before = _Block(old, start - old, block.stream, block.pool, seg)
            before.prev, before.next = block.prev, block
            if block.prev is not None:
                block.prev.next = before
            block.prev = before
            self._insert_free(before)
        if stop < old_end:
            after = _Block(stop, old_end - stop, block.stream, block.pool, seg)
            after.prev, after.next = block, block.next
            if block.next is not None:
                block.next.prev = after
            block.next = after
            self._insert_free(after)
        block.addr, block.size, block.mapped = start, stop - start, False
        for p in range(begin, end):
            self.backend.release(seg.pages.pop(p))
        # merge with unmapped neighbours first, then index the result (its address may move)
        prev = block.prev
        if prev is not None and not prev.allocated and not prev.mapped:
            self._merge(block, prev)
        nxt = block.next
        if nxt is not None and not nxt.allocated and not nxt.mapped:
            self._merge(block, nxt)
        self._insert_unmapped(block)
        self.reserved_bytes -= stop - start
        self.device_frees += 1

    def _release_expandable_segment(self, block: _Block) -> None:
        self._remove_unmapped(block)
        del self._segments[block.seg.addr]

    # ---- a recorded start state --------------------------------------------------------------
    def adopt_segment(self, size: int, small: bool, stream: int, blocks: list[tuple[int, int, bool]]) -> dict[int, _Block]:
        """Install a segment that existed before a replayed window; returns offset -> allocated block.

        Args:
            size: the segment's bytes (reserved from the backend now).
            small: True for a small-pool segment.
            stream: the stream it belongs to.
            blocks: (offset, size, allocated) covering the segment in address order; free
                neighbours are merged, as the allocator always keeps them.
        Returns:
            The allocated blocks by offset, for the replay to free later.
        """
        if self._expandable:
            raise ConfigError("a recorded start state can only be installed into caching without expandable segments")
        if sum(s for _, s, _ in blocks) != size:
            raise ConfigError(f"segment of {size} bytes: its blocks cover {sum(s for _, s, _ in blocks)}")
        addr = self.backend.reserve(size)
        if addr is None or self.reserved_bytes + size > self.limit:
            raise OutOfMemory(f"the recorded start state does not fit: segment of {size} bytes",
                              requested=size, rounded=size, in_use=self.bytes_in_use, pool_bytes=self.reserved_bytes,
                              limit=self.limit, largest_free_block=0, fragmentation=False, bins=[], occupancy="")
        pool = SMALL if small else LARGE
        seg = _Segment(addr, size, pool, stream, False, self._next_index)
        self._next_index += 1
        self._segments[addr] = seg
        self.reserved_bytes += size
        self.peak_pool_bytes = max(self.peak_pool_bytes, self.reserved_bytes)
        out: dict[int, _Block] = {}
        prev: _Block | None = None
        for offset, bsize, allocated in blocks:
            if prev is not None and not allocated and not prev.allocated:
                prev.size += bsize          # keep free space merged
                continue
            b = _Block(addr + offset, bsize, stream, pool, seg)
            b.allocated = allocated
            b.prev = prev
            if prev is not None:
                prev.next = b
            if seg.ref is None:
                seg.ref = b
            if allocated:
                b.requested = bsize
                out[offset] = b
                self.bytes_in_use += bsize
                self.num_allocs += 1
            prev = b
        for b2 in list(seg.blocks()):
            if not b2.allocated:
                self._insert_free(b2)
        self.peak_bytes_in_use = max(self.peak_bytes_in_use, self.bytes_in_use)
        return out

    # ---- introspection for tests and reports -------------------------------------------------
    def segments(self) -> list[dict[str, Any]]:
        """Plain-data view: each segment with its pool, stream and blocks, address order."""
        out = []
        for seg in sorted(self._segments.values(), key=lambda s: s.addr):
            blocks = [{"addr": b.addr, "size": b.size, "allocated": b.allocated, "mapped": b.mapped}
                      for b in seg.blocks()]
            out.append({"addr": seg.addr, "size": seg.size, "pool": "small" if seg.pool == SMALL else "large",
                        "stream": seg.stream, "expandable": seg.expandable, "blocks": blocks})
        return out


def make_caching_allocator(backend: Backend, *, limit: int, expandable: bool = False, **options: Any) -> CachingAllocator:
    """The registry's entry point for "caching" and "caching-expandable".

    >>> from jaxmem.runtime.backends import SimulatedBackend
    >>> make_caching_allocator(SimulatedBackend("8GiB"), limit=8 << 30, alloc_conf="max_split_size_mb:64").config.max_split_size
    67108864

    Args:
        backend: the device memory.
        limit: most bytes to reserve.
        expandable: turn expandable segments on.
        options: `alloc_conf` (a PYTORCH_CUDA_ALLOC_CONF string), `settings` (a snapshot's
            allocator_settings) or `config` (a CachingConfig); `preallocate` is accepted and
            ignored (this allocator grows on demand).
    Returns:
        A CachingAllocator.
    """
    options.pop("preallocate", None)
    config = options.pop("config", None)
    settings = options.pop("settings", None)
    alloc_conf = options.pop("alloc_conf", None)
    if options:
        raise ConfigError(f"unknown caching allocator option(s): {', '.join(sorted(options))}")
    if config is None:
        config = config_from_settings(settings) if settings else CachingConfig()
        if alloc_conf:
            config = parse_alloc_conf(alloc_conf, config)
    return CachingAllocator(backend, limit, config, expandable=True if expandable else None)
