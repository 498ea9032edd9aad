"""Live intervals: given a schedule, fusion and the aliasing rules, which buffers exist when.

Values that share storage (a view and its operand; an op written in place into a dying operand;
a loop carry written back into its initial buffer) form one buffer group. Each group is one
interval [start, end] over schedule positions (-1: on entry, n: on exit) with a size rounded to
256 bytes. The maximum over positions of the live bytes is the lower bound no placement beats.

    >>> live = assign_buffers(graph, order, fused, reads, scratch, external, outputs, donated)
    >>> live.peak, [(iv.start, iv.end, iv.size) for iv in live.intervals][:2]
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from jaxmem.compiler.fusion import align, op_is_view
from jaxmem.compiler.program import Program
from jaxmem.compiler.rules import inplace_candidates, storage_rule


@dataclass
class Interval:
    """One buffer group: the values sharing it, when it is live, how big it is."""

    id: int
    members: list[int]
    start: int
    end: int
    size: int
    kind: str          # "argument" | "output" | "temp" | "scratch"
    op: int = -1       # op index of the scratch owner


@dataclass
class Liveness:
    intervals: list[Interval]
    group: list[int]                 # value -> interval id, -1 when it has no arena buffer
    peak: int                        # max over positions of live bytes in the arena
    profile: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # index p+1


def assign_buffers(
    g: Program,
    order: list[int],
    fused: list[bool],
    reads: list[list[int]],
    scratch: dict[int, int],
    external: list[bool],
    outputs: list[bool],
    donated: list[bool],
    allow_inplace: bool = True,
    carry_of: dict[int, int] | None = None,
) -> Liveness:
    """Group values into buffers along a schedule and compute their live intervals.

    **Arguments:** the graph; `order`, op indices in execution order; `fused`, per value;
    `reads`, per op the stored values it reads (`fusion.expanded_reads`); `scratch`, op index ->
    bytes of a loop body's temporaries; per value flags: `external` (non-donated argument, outside
    the arena), `outputs` (program output), `donated` (donated argument, in the arena);
    `carry_of`, for a loop body, each new carry -> the old carry input whose buffer it shares.

    **Returns:** the `Liveness` (intervals, value -> interval, peak live bytes).
    """
    n = len(order)
    nv = g.num_values
    last = [-1] * nv
    for p, oi in enumerate(order):
        for u in reads[oi]:
            last[u] = p
    for v in range(nv):
        if outputs[v]:
            last[v] = n
    group = [-1] * nv
    intervals: list[Interval] = []
    glast: list[int] = []

    def new_group(v: int, start: int, kind: str) -> int:
        gid = len(intervals)
        intervals.append(Interval(gid, [v], start, start, align(g.nbytes[v]), kind))
        glast.append(max(last[v], start))
        group[v] = gid
        return gid

    for v in g.invars:
        if donated[v] and group[v] < 0:
            new_group(v, -1, "argument")

    for p, oi in enumerate(order):
        op = g.ops[oi]
        if scratch.get(oi, 0) > 0:
            gid = len(intervals)
            intervals.append(Interval(gid, [], p, p, align(scratch[oi]), "scratch", oi))
            glast.append(p)
        outs = op.outputs
        if not any(v is not None and not fused[v] for v in outs):
            continue
        rule = storage_rule(op.primitive)
        view = op_is_view(g, op)
        cands = inplace_candidates(op.primitive, op.eqn.params, op.operands, len(outs)) if allow_inplace else None
        if allow_inplace and op.primitive == "transpose" and _dot_result(g, op):
            # XLA rewrites transpose(dot(a, b)) into a dot that writes the transposed layout:
            # the transpose may take over its dying dot result's buffer.
            rule, cands = "update", [[0]]
        taken: set[int] = set()
        for k, o in enumerate(outs):
            if o is None or fused[o]:
                continue
            if external[o]:
                if _external_output(g, o, oi, p, k, rule, cands, reads, op, carry_of or {}, last,
                                    group, glast, intervals, taken, fused):
                    continue
                # A new loop carry that cannot be written into the loop state yet: a temporary.
                new_group(o, p, "temp")
                continue
            target = -1
            if view and op.inputs:
                u = op.inputs[0]
                if not fused[u] and group[u] >= 0 and align(g.nbytes[o]) <= intervals[group[u]].size:
                    target = group[u]
                    intervals[target].members.append(o)
                    group[o] = target
                    glast[target] = max(glast[target], last[o], p)
                    continue
            if cands is not None and cands[k]:
                if rule == "elementwise":
                    pool = reads[oi]
                else:
                    pool = [op.operands[i] for i in cands[k]]
                target = _pick_inplace(g, o, pool, p, group, glast, intervals, taken, fused, rule)
            if target >= 0:
                taken.add(target)
                intervals[target].members.append(o)
                group[o] = target
                glast[target] = max(last[o], p)
                continue
            new_group(o, p, "output" if outputs[o] else "temp")

    for iv in intervals:
        if iv.kind == "scratch":
            continue
        iv.end = max(glast[iv.id], iv.start)
        if any(outputs[v] for v in iv.members):
            iv.end = n
            if iv.kind == "temp":
                iv.kind = "output"
    profile = live_profile(intervals, n)
    peak = int(profile.max()) if len(profile) else 0
    return Liveness(intervals, group, peak, profile)


def _dot_result(g: Program, op) -> bool:
    src = op.inputs[0] if op.inputs else None
    return src is not None and g.producer[src] >= 0 and g.ops[g.producer[src]].primitive == "dot_general"


def _external_output(g, o, oi, p, k, rule, cands, reads, op, carry_of, last, group, glast,
                     intervals, taken, fused) -> bool:
    """Place an output that lives outside this plan (a loop body's result). True when it needs
    no buffer here: it is written into its own memory outside, possibly taking over a dying
    temporary (which then lives there too). False for a new carry that must wait in a temporary
    because the old carry, in the same outside buffer, is still read later."""
    old = carry_of.get(o)
    if old is not None and last[old] > p:
        return False
    if old is not None and last[old] == p and rule not in ("elementwise", "update"):
        return False  # a non-elementwise op cannot overwrite an operand it is reading
    if cands is not None and cands[k]:
        pool = reads[oi] if rule == "elementwise" else [op.operands[i] for i in cands[k]]
        target = _pick_inplace(g, o, pool, p, group, glast, intervals, taken, fused, rule)
        if target >= 0 and intervals[target].kind == "temp":
            start = intervals[target].start
            if old is None or start > last[old]:
                taken.add(target)
                intervals[target].kind = "external"
                intervals[target].size = 0
    return True


def _pick_inplace(g, o, pool, p, group, glast, intervals, taken, fused, rule) -> int:
    """The buffer group `o` may overwrite at position p, or -1."""
    need = align(g.nbytes[o])
    elems = _count(g.shapes[o])
    best, best_size = -1, None
    for u in pool:
        if not isinstance(u, int) or fused[u]:
            continue
        gid = group[u]
        if gid < 0 or gid in taken or glast[gid] > p:
            continue
        size = intervals[gid].size
        if size < need:
            continue
        if rule == "elementwise" and _count(g.shapes[u]) != elems:
            continue
        if rule != "elementwise" and g.nbytes[u] != g.nbytes[o]:
            continue
        if best_size is None or size < best_size:
            best, best_size = gid, size
    return best


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def live_profile(intervals: list[Interval], n: int) -> np.ndarray:
    """Live bytes at each position -1..n (array index p+1)."""
    diff = np.zeros(n + 3, dtype=np.int64)
    for iv in intervals:
        if iv.size:
            diff[iv.start + 1] += iv.size
            diff[iv.end + 2] -= iv.size
    return np.cumsum(diff)[: n + 2]
