"""Rewrites of the user's source that lower XLA's total before any checkpoint policy: a
differentiated max pool as strided slices and a pairwise max (`fitting.pools`), an activation's
small scaling factors multiplied together first (`fitting.scales`: a batch norm's
`x * rsqrt(var + eps) * gain` as `x * (rsqrt(var + eps) * gain)`), long attention in blocks of
queries (`fitting.attention`). Each is judged by XLA's total, its values compared
with the step as written (at the precision the step computes in), and kept only where the
total drops within the FLOP cap; fit's policies and `jaxmem optimize`'s order then start from
what was kept, and their answers print these lines first.

>>> kept = rewrite_first(step, args, (0, 1), Judge("h100-80gb"), original_total)  # doctest: +SKIP
>>> kept[-1].fn, kept[-1].lines                                                  # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax

from jaxmem.fitting.bound import FLOP_CAP


@dataclass
class SourceRewrite:
    """One rewrite kept: `fn` is the step with it and every rewrite kept before it."""

    kind: str                   # "max pools", "scale factors", "attention in blocks"
    lines: list[str]            # what to write in the user's code
    fn: Callable[..., Any]
    xla_total_bytes: int        # the judge's total for `fn`
    values_equal: bool | None   # None: the arguments are shapes only, nothing was run
    flops: int                  # `fn`'s FLOPs (`compiler.costs.jaxpr_flops`)
    extra_flops: int            # ... less the step's as written (negative: fewer)


def rewrite_first(fn: Callable[..., Any], args: Sequence[Any], donate: Sequence[int], judge: Any,
                  original_total: int, progress: Callable[[str], None] | None = None,
                  cap: float = FLOP_CAP) -> list[SourceRewrite]:
    """The rewrites kept, in order (each builds on the one before): `judge` is a
    `fitting.judge.Judge`, `original_total` its total for `fn`. A candidate is kept where its
    total is below the last kept, its values equal the step's as written (where the arguments
    are arrays) and its FLOPs are at most (1 + cap) times the step's."""
    from jaxmem.fitting.attention import attention_chunked, attention_lines, attention_sites, chunk_sizes
    from jaxmem.fitting.judge import compute_dtype, values_equal
    from jaxmem.fitting.policy import _flops  # counted as fit's policy candidates are: the shift is exact
    from jaxmem.fitting.pools import pool_lines, pool_sites, pools_rewritten
    from jaxmem.fitting.scales import scale_lines, scale_sites, scales_combined

    note = progress or (lambda label: None)
    concrete = not any(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in jax.tree.leaves(args))
    expected: list[Any] = []
    base_flops = _flops(fn, args)
    kept: list[SourceRewrite] = []

    def judged(kind: str, cand: Callable[..., Any], lines: list[str]) -> SourceRewrite | None:
        note(kind)
        try:
            flops = _flops(cand, args)
            if flops > (1 + cap) * base_flops:
                return None
            total = judge.total(cand, args, donate)
            if total >= (kept[-1].xla_total_bytes if kept else original_total):
                return None
            same = None
            if concrete:
                if not expected:
                    expected.append(jax.jit(fn)(*args))
                same = values_equal(expected[0], jax.jit(cand)(*args), compute_dtype(fn, args))
        except Exception:  # noqa: BLE001 - a rewrite JAX cannot trace, XLA compile or run is not offered
            return None
        if same is False:
            return None
        return SourceRewrite(kind, lines, cand, total, same, flops, flops - base_flops)

    def found_in(find: Callable[[Callable[..., Any], Sequence[Any]], list[Any]]) -> list[Any]:
        try:
            return find(current, args)
        except Exception:  # noqa: BLE001 - a step the hooks cannot trace keeps its source as written
            return []

    current = fn
    # In this order: the batch norm's factors pay only once the pools' index arrays are gone.
    for kind, find, rewrite, lines in (("max pools", pool_sites, pools_rewritten, pool_lines),
                                       ("scale factors", scale_sites, scales_combined, scale_lines)):
        sites = found_in(find)
        found = judged(kind, rewrite(current, sites), lines(sites)) if sites else None
        if found is not None:
            kept.append(found)
            current = found.fn
    calls = found_in(attention_sites)
    if calls:
        best = None
        for chunk in chunk_sizes(calls):
            found = judged("attention in blocks", attention_chunked(current, calls, chunk),
                           attention_lines(calls, chunk))
            if found is not None and (best is None or found.xla_total_bytes < best.xla_total_bytes):
                best = found
        if best is not None:
            kept.append(best)
    return kept
