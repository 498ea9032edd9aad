"""The XLA:GPU model's scheduling pass: the orders XLA:GPU's memory scheduler tries.

XLA's memory scheduler (xla/service/hlo_memory_scheduler.cc: DefaultMemoryScheduler) runs its
list, DFS and post-order schedulers and keeps the order with the least memory. The model tries
the planner's list and DFS schedulers over the fused program; the program's (jaxpr) order is
not among XLA's, and taking it ran the loss's gather of log-softmax before the cross-entropy
gradient where XLA runs it after (the dumps of transformer_wide_train,
scanned_checkpoint_train). GEMMs the dot merger joins (xla/service/gpu/transforms/dot_merger.cc)
run together where the first of them ran (`merged_order`).
"""

from __future__ import annotations

from jaxmem.compiler.program import Program
from jaxmem.compiler.stages import Analysis

# The planner's schedulers that stand for XLA's (list and DFS; hlo_memory_scheduler.cc).
XLA_SCHEDULERS = ("list", "dfs")


def xla_orders(g: Program, analysis: Analysis) -> dict[str, list[int]]:
    """Per scheduler of `XLA_SCHEDULERS`, its order of `g`'s ops under `analysis`."""
    from jaxmem.compiler import planner  # the planner imports the GPU model lazily too

    return {name: planner.SCHEDULERS[name](g, analysis) for name in XLA_SCHEDULERS}


def merged_order(order: list[int], groups: list[list[int]]) -> list[int]:
    """The order with each merged group run together where its first member ran."""
    if not groups:
        return order
    later = {m for grp in groups for m in grp[1:]}
    lead = {grp[0]: grp for grp in groups}
    out = []
    for oi in order:
        if oi in later:
            continue
        out.extend(lead.get(oi, [oi]))
    return out
