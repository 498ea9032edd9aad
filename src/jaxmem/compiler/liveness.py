"""Live intervals: given a schedule, fusion and the storage rules, which buffers exist when.

Values that share storage (a view and its operand; an op written in place into a dying operand;
a loop carry written back into its initial buffer) form one buffer group. Each group is one
interval [start, end] over schedule positions (-1: on entry, n: on exit) with a size rounded to
256 bytes. The maximum over positions of the live bytes is the lower bound no placement beats.

    >>> from jaxmem.compiler.doc_example import sin_analysis
    >>> program, order, analysis = sin_analysis()   # sin(x) * 2 over f32[4], fusion chosen
    >>> live = assign_buffers(program, order, analysis)
    >>> live.peak, [(iv.start, iv.end, iv.size) for iv in live.intervals][:2]
    (256, [(1, 2, 256)])
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
import numpy as np

from jaxmem.compiler.fusion import op_is_view, op_views, reads_fused_gemm
from jaxmem.compiler.program import Op, Program, side_table
from jaxmem.compiler.rules import DOT_LIKE, inplace_candidates, storage_rule
from jaxmem.compiler.stages import Analysis, align, live_profile


@dataclass(slots=True)
class Interval:
    """One buffer group: the values sharing it, when it is live, how big it is."""

    id: int
    members: list[int]
    start: int
    end: int
    size: int
    # "argument" (donated) | "output" | "temp" | "scratch" (a loop body's temporaries) |
    # "external": a temporary a loop body's result took over, so it lives in the loop's own
    # buffer outside this plan (size 0 here)
    kind: str
    op: int = -1       # op index of the scratch owner


class Liveness:
    """The buffer groups of one schedule: `intervals` (one per group, by id), `group` (value ->
    interval id, -1 when it has no arena buffer), `peak` (max over positions of live bytes in
    the arena) and `profile` (live bytes at each position, index p+1).

    The planner scores many schedules and looks at the intervals of the one it keeps only, so
    `assign_buffers` hands them over as columns and the `Interval` objects are made on first use.
    """

    def __init__(self, intervals: list[Interval] | None, group: list[int], peak: int,
                 profile: np.ndarray | None = None, columns: tuple | None = None) -> None:
        self._intervals = intervals
        self._columns = columns   # (starts, ends, sizes, kinds, members, ops), one entry per group
        self.group = group
        self.peak = peak
        self.profile = np.zeros(0, np.int64) if profile is None else profile

    @property
    def intervals(self) -> list[Interval]:
        if self._intervals is None:
            starts, ends, sizes, kinds, members, ops = self._columns
            self._intervals = [Interval(k, members[k], starts[k], ends[k], sizes[k], kinds[k], ops[k])
                               for k in range(len(starts))]
            self._columns = None
        return self._intervals


def assign_buffers(g: Program, order: list[int], analysis: Analysis, allow_inplace: bool = True) -> Liveness:
    """Group values into buffers along a schedule and compute their live intervals.

    **Arguments:** the program; `order`, op indices in execution order; `analysis`, the values'
    roles, the fusion (fused values, what each op reads) and each loop op's scratch bytes;
    `allow_inplace`, False to give every output a fresh buffer (for comparison).

    **Returns:** the `Liveness` (intervals, value -> interval, peak live bytes).
    """
    b = _Groups(g, order, analysis)
    # locals: this loop runs once per op for every schedule the planner scores
    group, glast, last, reads = b.group, b.glast, b.last, b.reads
    starts, sizes, kinds, members, owners = b.starts, b.sizes, b.kinds, b.members, b.owners
    fused, external, outputs = analysis.fusion.fused, analysis.roles.external, analysis.roles.outputs
    scratch = analysis.scratch
    for v in g.invars:
        if analysis.roles.donated[v] and group[v] < 0:
            b.new_group(v, -1, "argument")

    asize = side_table(g, ("aligned", g.num_values), _aligned)   # align(nbytes[v]), per value
    stored = stored_outputs(g, fused, reads, allow_inplace)
    pick_inplace = b.pick_inplace
    for p, oi in enumerate(order):
        if oi in scratch and scratch[oi] > 0:
            b.add(p, align(scratch[oi]), "scratch", [], oi)
            glast.append(p)
        entry = stored[oi]
        if entry is None:
            continue  # nothing stored
        rule, src, outs = entry
        taken: set[int] = set()
        for o, pool in outs:
            if external[o]:
                if b.external_output(o, p, rule, pool, taken):
                    continue
                # A new loop carry that cannot be written into the loop state yet: a temporary.
                b.new_group(o, p, "temp")
                continue
            if src >= 0:
                gid = group[src]
                if gid >= 0 and asize[o] <= sizes[gid]:
                    b.join(o, gid, max(glast[gid], last[o], p))
                    continue
            target = pick_inplace(o, pool, p, taken) if pool else -1
            if target >= 0:
                taken.add(target)
                members[target].append(o)
                group[o] = target
                glast[target] = max(last[o], p)
                continue
            # a new group (`_Groups.new_group`, inlined: most stored values make one)
            group[o] = len(starts)
            starts.append(p)
            sizes.append(asize[o])
            kinds.append("output" if outputs[o] else "temp")
            members.append([o])
            owners.append(-1)
            glast.append(last[o] if last[o] > p else p)

    n = len(order)
    # the groups holding a program output (a member's role), which live to the exit
    held = {group[v] for v in itertools.compress(range(len(outputs)), outputs)} - {-1}
    ends = []
    for gid, start in enumerate(starts):
        if kinds[gid] == "scratch":
            ends.append(start)
        elif gid in held:
            ends.append(n)
            if kinds[gid] == "temp":
                kinds[gid] = "output"
        else:
            ends.append(glast[gid] if glast[gid] > start else start)
    profile = live_profile(list(zip(starts, ends, sizes)), n)
    peak = int(profile.max()) if len(profile) else 0
    return Liveness(None, group, peak, profile, (starts, ends, sizes, kinds, members, owners))


Stored = tuple[str, int, list[tuple[int, list[int] | None]]]


def stored_outputs(g: Program, fused: list[bool], reads: list[list[int]],
                   allow_inplace: bool = True) -> list[Stored | None]:
    """Per op, what `assign_buffers` decides without the schedule, the same for every order
    scored under one fusion: None when the op stores nothing, else (its storage rule, the
    stored operand a view shares, or -1, and per stored output the buffers' values it may
    overwrite: in-place candidates already narrowed to stored values of the right size, or
    None). A side table per fusion, so the schedules of one plan share it; read-only.
    """
    key = ("stored", bytes(fused), allow_inplace)
    hit = side_table(g, key, lambda g: (reads, _stored_outputs(g, fused, reads, allow_inplace)))
    if hit[0] is not reads:  # another `reads` for the same fusion (a hand-made Analysis)
        return _stored_outputs(g, fused, reads, allow_inplace)
    return hit[1]


def _stored_outputs(g: Program, fused: list[bool], reads: list[list[int]], allow_inplace: bool) -> list[Stored | None]:
    facts = op_facts(g)
    elems = side_table(g, ("elements", g.num_values), _elements)
    nbytes = g.nbytes
    # only a GPU target's base fusion puts GEMMs inside sums (`fusion.gemm_epilogues`)
    any_epilogue = any(fused[op.outputs[0]] for op in side_table(g, "gemms", _gemms))
    table: list[Stored | None] = []
    for oi, op in enumerate(g.ops):
        for v in op.outputs:
            if v is not None and not fused[v]:
                break
        else:
            table.append(None)  # nothing stored
            continue
        rule, view, cands = facts[oi] if allow_inplace else (storage_rule(op.primitive), op_is_view(g, op), None)
        epilogue = any_epilogue and rule == "elementwise" and reads_fused_gemm(g, fused, op)
        src = op.inputs[0] if view and op.inputs and not fused[op.inputs[0]] else -1
        outs = []
        for k, o in enumerate(op.outputs):
            if o is None or fused[o]:
                continue
            pool = None
            if cands is not None and cands[k]:
                if rule != "elementwise":
                    pool = [op.operands[i] for i in cands[k]]
                elif epilogue:
                    # a GEMM's epilogue reads the GEMM's operands while it writes: only the
                    # summand it reads itself may be overwritten
                    pool = [u for u in op.inputs if not fused[u]]
                else:
                    pool = reads[oi]
                # stored values only; an elementwise op writes over an operand of as many
                # elements, any other over one of as many bytes
                if rule == "elementwise":
                    pool = [u for u in pool if isinstance(u, int) and not fused[u] and elems[u] == elems[o]]
                else:
                    pool = [u for u in pool if isinstance(u, int) and not fused[u] and nbytes[u] == nbytes[o]]
            outs.append((o, pool))
        table.append((rule, src, outs))
    return table


def _aligned(g: Program) -> list[int]:
    """Per value, its bytes in the arena (a side table: values only grow, so keyed by their number)."""
    return [align(b) for b in g.nbytes]


def _elements(g: Program) -> list[int]:
    """Per value, its element count."""
    return [_count(shape) for shape in g.shapes]


def op_facts(g: Program) -> list[tuple[str, bool, list[list[int]]]]:
    """Per op: (storage rule, is a view, in-place candidate operand positions per output), as
    `assign_buffers` applies them with in-place sharing on; computed once per op list."""
    return side_table(g, "storage", _op_facts)


def _gemms(g: Program) -> list[Op]:
    """The dot-like ops with one output."""
    return [op for op in g.ops if op.primitive in DOT_LIKE and len(op.outputs) == 1 and op.outputs[0] is not None]


def _op_facts(g: Program) -> list[tuple[str, bool, list[list[int]]]]:
    views = side_table(g, "views", op_views)
    facts = []
    # Loops' candidates depend on their parameters; every other op's on its primitive and
    # operand and output counts only: those are made once per kind (read-only, shared).
    shared: dict[tuple[str, int, int], list[list[int]]] = {}
    for k, op in enumerate(g.ops):
        rule = storage_rule(op.primitive)
        if op.primitive in ("scan", "while"):
            cands = inplace_candidates(op.primitive, op.params, op.operands, len(op.outputs))
        else:
            kind = (op.primitive, len(op.operands), len(op.outputs))
            cands = shared.get(kind)
            if cands is None:
                cands = shared[kind] = inplace_candidates(op.primitive, op.params, op.operands, len(op.outputs))
        if op.primitive == "transpose" and _dot_result(g, op):
            # XLA rewrites transpose(dot(a, b)) into a dot that writes the transposed layout:
            # the transpose may take over its dying dot result's buffer.
            rule, cands = "update", [[0]]
        facts.append((rule, views[k], cands))
    return facts


class _Groups:
    """The buffer groups being built along a schedule: intervals, each value's group, each
    group's last use so far, each value's last read."""

    def __init__(self, g: Program, order: list[int], analysis: Analysis) -> None:
        self.g = g
        self.fused = analysis.fusion.fused
        self.reads = analysis.fusion.reads
        self.carry_of = analysis.roles.carry_of
        nv = g.num_values
        last = self.last = [-1] * nv
        reads = self.reads
        for p, oi in enumerate(order):
            for u in reads[oi]:
                last[u] = p
        n = len(order)
        for v in itertools.compress(range(nv), analysis.roles.outputs):
            last[v] = n
        self.group = [-1] * nv
        # the groups, as columns (made `Interval`s only when asked: `Liveness.intervals`)
        self.starts: list[int] = []
        self.sizes: list[int] = []
        self.kinds: list[str] = []
        self.members: list[list[int]] = []
        self.owners: list[int] = []     # the op owning a scratch group, else -1
        self.glast: list[int] = []
        self.asize = side_table(g, ("aligned", g.num_values), _aligned)

    def add(self, start: int, size: int, kind: str, members: list[int], owner: int = -1) -> int:
        """A new group; its last use is for the caller to add to `glast`."""
        self.starts.append(start)
        self.sizes.append(size)
        self.kinds.append(kind)
        self.members.append(members)
        self.owners.append(owner)
        return len(self.starts) - 1

    def new_group(self, v: int, start: int, kind: str) -> int:
        gid = self.add(start, self.asize[v], kind, [v])
        self.glast.append(max(self.last[v], start))
        self.group[v] = gid
        return gid

    def join(self, v: int, gid: int, glast: int) -> None:
        self.members[gid].append(v)
        self.group[v] = gid
        self.glast[gid] = glast

    def external_output(self, o: int, p: int, rule: str, pool: list | None, taken: set[int]) -> bool:
        """Place an output that lives outside this plan (a loop body's result). True when it
        needs no buffer here: it is written into its own memory outside, possibly taking over a
        dying temporary (which then lives there too: kind "external"). False for a new carry
        that must wait in a temporary because the old carry, in the same outside buffer, is
        still read later."""
        old = self.carry_of.get(o)
        if old is not None and self.last[old] > p:
            return False
        if old is not None and self.last[old] == p and rule not in ("elementwise", "update"):
            return False  # a non-elementwise op cannot overwrite an operand it is reading
        if pool is not None:
            target = self.pick_inplace(o, pool, p, taken)
            if target >= 0 and self.kinds[target] == "temp":
                start = self.starts[target]
                if old is None or start > self.last[old]:
                    taken.add(target)
                    self.kinds[target] = "external"
                    self.sizes[target] = 0
        return True

    def pick_inplace(self, o: int, pool: list, p: int, taken: set[int]) -> int:
        """The buffer group `o` may overwrite at position p (the smallest that fits), or -1;
        `pool`: the stored values of the right size it may overwrite (`stored_outputs`)."""
        group, glast, sizes = self.group, self.glast, self.sizes
        need = self.asize[o]
        best, best_size = -1, None
        for u in pool:
            gid = group[u]
            if gid < 0 or gid in taken or glast[gid] > p:
                continue
            size = sizes[gid]
            if size < need:
                continue
            if best_size is None or size < best_size:
                best, best_size = gid, size
        return best


def _dot_result(g: Program, op: Op) -> bool:
    src = op.inputs[0] if op.inputs else None
    return src is not None and g.producer[src] >= 0 and g.ops[g.producer[src]].primitive == "dot_general"


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
