"""Errors a user can cause. Each carries a one-line message the CLI prints as is."""

from __future__ import annotations


class JaxmemError(Exception):
    """Base of every error jaxmem raises on purpose; the CLI prints `str(err)` on one line, exit 2."""


class ConfigError(JaxmemError, ValueError):
    """A bad setting: an environment variable, a capacity, an allocator name."""


class AllocationError(JaxmemError, ValueError):
    """A bad allocator call: size not a positive int, alignment not a power of two, double free."""


class OutOfMemory(JaxmemError, MemoryError):
    """The allocator could not satisfy a request. The pool is left exactly as it was.

    Attributes are filled by the allocator that raised it: `requested`, `rounded`, `in_use`,
    `pool_bytes`, `limit`, `largest_free_block`, `fragmentation` (True when the free total
    would have fit), `bins` (per-bin summary rows) and `occupancy` (one line of '*' and '_').
    """

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.details = details
        for key, value in details.items():
            setattr(self, key, value)


class TraceError(JaxmemError):
    """A trace file that cannot be read: truncated, corrupt, hostile, or inconsistent."""


class PlanError(JaxmemError):
    """A program jaxmem cannot plan or run: a bad TARGET, an arena too small, an invalid plan."""


class LedgerError(JaxmemError):
    """The shared-GPU reservation ledger is corrupt, or a reservation cannot be had."""
