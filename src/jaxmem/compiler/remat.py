"""Rematerialization in the user's terms: which values a rewrite recomputes, and how it keeps
XLA from merging the recompute back.

The rewriting itself is `remat_graph` (a program with recompute groups, turned back into a
function) and `remat_search` (the sequence of rewrites, each recomputing one more group). What
a chosen rewrite recomputes is described here (`recomputed_values`), and the guard that keeps
the recompute apart is chosen here (`resolve_guard`). `jaxmem.fit` (`fitting/fit.py`), on the
floor above, judges the rewrites with XLA and picks one.

>>> resolve_guard("barrier"), resolve_guard("auto") in ("cond", "barrier")
('barrier', True)
"""

from __future__ import annotations

from dataclasses import dataclass

import jax

from jaxmem.compiler.plan_types import SourceLine
from jaxmem.compiler.remat_graph import Graph
from jaxmem.compiler.remat_search import Snapshot
from jaxmem.errors import ConfigError


@dataclass(frozen=True)
class RecomputedValue:
    """One value the rewrite drops after its forward uses and recomputes before its later ones."""

    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    primitive: str                 # what makes it
    source: SourceLine | None      # where the user's code made it
    chain: tuple[str, ...]         # the primitives recomputed with it (its group's chain)
    flops: int                     # FLOPs of that chain


def resolve_guard(guard: str) -> str:
    """How recomputation is kept from being merged back by XLA: "cond" or "barrier" ("auto":
    by this process's backend)."""
    if guard == "auto":
        # XLA:CPU drops optimization barriers before its last CSE pass; GPU/TPU keep them
        # until after scheduling, where the cheaper barrier is enough.
        return "cond" if jax.default_backend() == "cpu" else "barrier"
    if guard not in ("cond", "barrier"):
        raise ConfigError(f"guard must be 'auto', 'cond' or 'barrier', got {guard!r}")
    return guard


def recomputed_values(graph: Graph, snap: Snapshot) -> list[RecomputedValue]:
    """The values `snap`'s recompute groups drop and recompute, in `graph`'s terms."""
    found = []
    for group in snap.groups:
        for vid, maker in zip(group.values, group.makers):
            p = graph.program
            found.append(RecomputedValue(p.shapes[vid], p.dtypes[vid], p.nbytes[vid], maker, p.sources[vid],
                                         tuple(group.primitives), group.flops))
    return found


__all__ = ["RecomputedValue", "recomputed_values", "resolve_guard"]
