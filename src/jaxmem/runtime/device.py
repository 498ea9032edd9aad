"""`Device`: one accelerator's memory, a backend carved by a named allocator.

    device = Device("80GiB")                       # simulated, BFC, preallocated 0.75
    buf = device.allocate(4 << 20)
    device.memory_stats()["bytes_in_use"]          # 4194304
    device.free(buf)
    Device.from_env("h100-80gb")                   # as JAX would set it up from the environment
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Iterator, Mapping

from jaxmem.errors import AllocationError
from jaxmem.runtime.allocator import Allocator, Buffer, Chunk
from jaxmem.runtime.backends import make_backend
from jaxmem.runtime.dump import occupancy
from jaxmem.runtime.config import DEFAULT_MEM_FRACTION, check_mem_fraction, config_from_env
from jaxmem.runtime.registry import make_allocator
from jaxmem.units import format_size, parse_size

# Allocators with no pool: JAX's fraction cap does not apply to them.
_NO_POOL = {"platform"}


class Device:
    """A simulated or host device whose memory an allocator hands out.

    >>> device = Device("1GiB", allocator="bfc", preallocate=False)
    >>> buf = device.allocate(1000)
    >>> buf.size, device.memory_stats()["pool_bytes"]
    (1024, 2097152)

    Args:
        capacity: bytes, "16GiB"/"80GB", or a preset such as "h100-80gb".
        backend: "simulated" (addresses only, any size) or "host" (one real numpy buffer).
        allocator: a name from `jaxmem.runtime.registry.ALLOCATOR_NAMES` ("bfc", "platform", ...).
        preallocate: take the whole pool at creation (JAX's default) or grow it on demand.
        mem_fraction: the share of capacity the pool may hold (JAX's default 0.75).
        unified_memory: allow mem_fraction above 1, as TF_FORCE_UNIFIED_MEMORY=1 does.
        options: passed to the allocator.
    """

    def __init__(self, capacity: int | str, *, backend: str = "simulated", allocator: str = "bfc",
                 preallocate: bool = True, mem_fraction: float = DEFAULT_MEM_FRACTION,
                 unified_memory: bool = False, **options: Any) -> None:
        self.capacity = parse_size(capacity)
        self.mem_fraction = check_mem_fraction(mem_fraction, unified_memory=unified_memory)
        self.preallocate = bool(preallocate)
        self.backend = make_backend(backend, self.capacity)
        limit = self.capacity if allocator in _NO_POOL else int(self.capacity * self.mem_fraction)
        self.allocator: Allocator = make_allocator(
            allocator, self.backend, limit=limit, preallocate=self.preallocate, **options)
        self.allocator_name = allocator
        # "bfc-growth" never preallocates, whatever was asked: report what the pool does.
        self.preallocate = bool(getattr(self.allocator, "preallocate", self.preallocate))
        # Host views handed out, id(buffer) -> (buffer, weak references to them), and the freed
        # buffers whose bytes wait for their last view to go (see `view`).
        self._views: dict[int, tuple[Buffer, list[weakref.ref]]] = {}
        self._held: list[tuple[Buffer, list[weakref.ref]]] = []

    @classmethod
    def from_env(cls, capacity: int | str, *, backend: str = "simulated",
                 environ: Mapping[str, str] | None = None) -> "Device":
        """A device set up from JAX's environment variables (see `jaxmem.runtime.config`).

        >>> Device.from_env("16GiB", environ={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}).preallocate
        False
        """
        config = config_from_env(environ)
        return cls(capacity, backend=backend, allocator=config.allocator, preallocate=config.preallocate,
                   mem_fraction=config.mem_fraction, unified_memory=config.unified_memory)

    def allocate(self, size: int, *, alignment: int = 256, stream: int = 0) -> Buffer:
        """A new buffer of at least `size` bytes; raises `OutOfMemory` when it cannot be had."""
        self._settle()
        return self.allocator.allocate(size, alignment=alignment, stream=stream)

    def free(self, buffer: Buffer) -> None:
        """Give `buffer` back to the pool. If host views of it are still alive (see `view`), they
        turn read-only and its bytes go back only once the last of them is gone."""
        self._settle()
        entry = self._views.get(id(buffer))
        views = [r for r in entry[1] if r() is not None] if entry and entry[0] is buffer else []
        if views and buffer.live:
            gc.collect()   # views in a reference cycle nobody can reach any more are not alive
            views = [r for r in views if r() is not None]
        if not views or not buffer.live:
            self.allocator.free(buffer)   # which refuses a double free or a foreign buffer
        else:
            for ref in views:
                view = ref()
                if view is not None:
                    view.flags.writeable = False
            buffer.live = False
            self._held.append((buffer, views))
        if entry and entry[0] is buffer:
            del self._views[id(buffer)]

    def _settle(self) -> None:
        """Give back the bytes of freed buffers whose last host view has gone."""
        if not self._held:
            return
        held, self._held = self._held, []
        for buffer, views in held:
            if any(ref() is not None for ref in views):
                self._held.append((buffer, views))
            else:
                buffer.live = True   # freed for its owner already; the pool takes it back now
                self.allocator.free(buffer)

    def memory_stats(self) -> dict[str, int | float]:
        """The keys and meanings of `jax.Device.memory_stats()`, plus `fragmentation`. A freed
        buffer whose host views are still alive counts as in use (see `view`)."""
        self._settle()
        return self.allocator.memory_stats()

    def reset_peak_stats(self) -> None:
        """Start the peak counters again from now."""
        self.allocator.reset_peak_stats()

    def empty_cache(self) -> int:
        """Return wholly free regions to the device; the bytes given back."""
        self._settle()
        return self.allocator.empty_cache()

    def chunks(self) -> Iterator[Chunk]:
        """Every piece of the pool, in address order."""
        self._settle()
        return self.allocator.chunks()

    def view(self, buffer: Buffer):
        """A writable numpy uint8 view of the buffer's `requested_size` bytes (host backend).

        A view never writes into another buffer's bytes. Once the buffer is freed, the views
        `view` returned turn read-only (writing raises `ValueError`) and no new view is given;
        views made from them before the free (a slice, `.view(np.float32)`) numpy cannot make
        read-only, so the freed bytes stay held, counted in use, until every view of them is
        gone, and only then can a new allocation get them. Drop views before `free` (or with
        it) and the bytes go back at once.

        >>> import numpy as np
        >>> device = Device("1MiB", backend="host")
        >>> buf = device.allocate(1024)
        >>> v = device.view(buf)
        >>> v[:] = 7
        >>> device.free(buf)
        >>> v[0] = 1
        Traceback (most recent call last):
        ValueError: assignment destination is read-only
        >>> device.memory_stats()["bytes_in_use"]   # held while `v` is alive
        1024
        >>> del v
        >>> device.memory_stats()["bytes_in_use"]
        0
        """
        self._settle()
        if not isinstance(buffer, Buffer) or buffer.owner is not self.allocator:
            raise AllocationError(f"{buffer!r} does not belong to this device")
        if not buffer.live:
            raise AllocationError(f"{buffer!r} has been freed")
        view = self.backend.view(buffer.address, buffer.requested_size)
        entry = self._views.get(id(buffer))
        if entry is None or entry[0] is not buffer:
            entry = self._views[id(buffer)] = (buffer, [])
        entry[1][:] = [ref for ref in entry[1] if ref() is not None]
        entry[1].append(weakref.ref(view))
        return view

    def occupancy_map(self, width: int = 100) -> str:
        """One line over the pool: '*' where a cell is at least half in use, '_' otherwise."""
        return occupancy(list(self.chunks()), width)

    def __repr__(self) -> str:
        mode = "" if self.allocator_name in _NO_POOL else (
            f", preallocate={self.preallocate}, mem_fraction={self.mem_fraction}")
        return (f"Device({format_size(self.capacity)}, backend={self.backend.kind!r}, "
                f"allocator={self.allocator_name!r}{mode})")
