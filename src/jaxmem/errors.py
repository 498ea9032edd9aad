"""Errors a user can cause. Each carries a one-line message the CLI prints as is.

Every error class jaxmem raises is defined here, so `except` clauses and the CLI have one place
to look. The one kind of exception left elsewhere are the allocators' `OutOfMemory` subclasses
(`runtime.dump.PoolOutOfMemory`, `runtime.bfc.BFCOutOfMemory`): they are `OutOfMemory` here,
and carry code that reads the pool they failed in, which belongs beside the pool.
"""

from __future__ import annotations

import reprlib


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


class ShardingError(PlanError):
    """A sharded TARGET jaxmem cannot map onto devices: a mesh larger than the preset's topology,
    a sharding that does not divide a shape, a mesh axis the function names but the mesh lacks."""


class LedgerError(JaxmemError):
    """The shared-GPU reservation ledger is corrupt, or a reservation cannot be had."""


class LedgerCorrupt(LedgerError):
    """The ledger file cannot be trusted; the message names it and the repair command."""


class JournalUnusable(LedgerError):
    """A ledger's journal gives nothing to rebuild from; only `share repair --reset` can go on."""


class OomTextError(JaxmemError):
    """An error text or log that cannot be read, or that holds no out-of-memory error jaxmem knows."""


class ReportError(JaxmemError):
    """A report that cannot be written: an unwritable path, a step outside the program."""


_QUOTE = reprlib.Repr()
_QUOTE.maxlevel = 3
_QUOTE.maxtuple = _QUOTE.maxlist = _QUOTE.maxarray = _QUOTE.maxdict = 4
_QUOTE.maxset = _QUOTE.maxfrozenset = _QUOTE.maxdeque = 4
_QUOTE.maxstring, _QUOTE.maxlong, _QUOTE.maxother = 60, 40, 60


def quote(value: object) -> str:
    """A short repr of a value from a file, for an error message: at most ~80 characters.

    Bounded work whatever the value: nested or shared structures are cut at depth 3 and four
    items, long strings to a prefix (a 50 MB string where an integer belongs must not become a
    50 MB message, nor a list whose items share structure a repr that never ends).

    >>> quote("x" * 10**6)[:20]
    "'xxxxxxxxxxxxxxxxxxx"
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"<an integer of {value.bit_length()} bits>"
    try:
        text = _QUOTE.repr(value)
    except (ValueError, RecursionError, TypeError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."
