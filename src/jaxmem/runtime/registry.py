"""Allocators by name: the one place that knows which class each name means.

    alloc = make_allocator("bfc-growth", SimulatedBackend("16GiB"), limit=12 << 30)

Names: "bfc" (XLA's BFC, preallocated unless preallocate=False), "bfc-growth" (BFC with
preallocation off), "platform" (one device allocation per buffer), and "caching" /
"caching-expandable" (PyTorch's caching allocator, from `jaxmem.runtime.caching`, imported
only when asked for).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from jaxmem.errors import ConfigError
from jaxmem.runtime.allocator import Allocator, Backend


def _bfc(backend: Backend, *, limit: int, preallocate: bool = True, **options: Any) -> Allocator:
    from jaxmem.runtime.bfc import BFCAllocator

    return BFCAllocator(backend, limit, preallocate=preallocate, **options)


def _bfc_growth(backend: Backend, *, limit: int, preallocate: bool = True, **options: Any) -> Allocator:
    from jaxmem.runtime.bfc import BFCAllocator

    allocator = BFCAllocator(backend, limit, preallocate=False, **options)
    allocator.name = options.get("name", "bfc-growth")
    return allocator


def _platform(backend: Backend, *, limit: int, preallocate: bool = True, **options: Any) -> Allocator:
    from jaxmem.runtime.platform import PlatformAllocator

    return PlatformAllocator(backend, limit, **options)


def _caching(expandable: bool) -> Callable[..., Allocator]:
    def make(backend: Backend, *, limit: int, preallocate: bool = True, **options: Any) -> Allocator:
        try:
            module = importlib.import_module("jaxmem.runtime.caching")
        except ImportError as err:
            raise ConfigError(f"the caching allocator is not available: {err}") from None
        return module.make_caching_allocator(backend, limit=limit, expandable=expandable, **options)

    return make


# name -> factory(backend, *, limit, preallocate, **options). Adding an allocator is one line.
FACTORIES: dict[str, Callable[..., Allocator]] = {
    "bfc": _bfc,
    "bfc-growth": _bfc_growth,
    "platform": _platform,
    "caching": _caching(False),
    "caching-expandable": _caching(True),
}

ALLOCATOR_NAMES: tuple[str, ...] = tuple(FACTORIES)


def make_allocator(name: str, backend: Backend, *, limit: int, preallocate: bool = True, **options: Any) -> Allocator:
    """The allocator called `name`, carving `backend`, holding at most `limit` bytes.

    >>> from jaxmem.runtime.backends import SimulatedBackend
    >>> make_allocator("platform", SimulatedBackend("1GiB"), limit=1 << 30).name
    'platform'

    Args:
        name: one of `ALLOCATOR_NAMES`.
        backend: the device memory it carves.
        limit: the most bytes its pool may hold.
        preallocate: for "bfc", take the whole limit at creation (JAX's default).
        options: passed to the allocator (e.g. `name=` for messages).

    Returns:
        An `Allocator`.
    """
    factory = FACTORIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown allocator {name!r}; one of: {', '.join(ALLOCATOR_NAMES)}")
    return factory(backend, limit=limit, preallocate=preallocate, **options)
