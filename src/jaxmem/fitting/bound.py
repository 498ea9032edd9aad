"""A lower bound on XLA:GPU's total (argument + output + temp - alias) that holds for every
rematerialization and every order of a training step: when it exceeds the budget, no
`jax.checkpoint` policy, rewrite or reordering can meet it.

Why it holds (read from XLA's buffer assignment, `service/buffer_assignment.cc`):
- Every argument and every output has an allocation of its own for the whole program (a
  donated argument shares one with the output it aliases): `floor` = arguments + outputs -
  aliases. A temporary may take such an allocation only while none of its own values is live
  (`MaybeAssignBuffer`: readonly parameters never; the others when the live ranges do not
  interfere), so at any moment the total is at least `floor` + (temporaries live then) -
  (bytes of argument/output allocations free then).
- Some operations must hold their materialized operands and their result at once. A
  scatter (the gradient of a gather: an embedding table, the experts' weights of a MoE) is
  always the root of its fusion: nothing consumes it inside a fusion, and it shares a buffer
  only with its base operand (operand 0), so its result (unless it is a program output) and
  its updates' materialized producers coexist. A GEMM or convolution (`dot_general` with a
  contraction, `conv_general_dilated`) takes elementwise producers of its operands into its
  fusion (Triton) and elementwise consumers as an epilogue, but never another dot, reduction or
  scatter; so what enters it is materialized somewhere on every path from the nearest such
  operation (a "hero") to it, and what leaves it somewhere on its elementwise consumers.
- A cut through those paths costs at least, for every path, the smallest value on it (a
  program argument or output costs nothing: it is in `floor` already). Of the operands, only
  the largest such cost is counted (two operands may share one cut), so the bound stays low
  where fusion could do better than we model.
- Two GEMMs, convolutions or scatters d1, d2 whose results one later op C reads (a softmax
  backward reading the scores' GEMM and the incoming gradient's GEMM): whichever instance of the
  two runs later writes its result while a value made from the other's instance, on its way to
  C, is live (`_pair_bound`). This holds for every policy and order: recomputation only adds
  instances, and C reads one of each.
- The same pair counted at C's own kernel, which holds for offload policies too
  (`_pair_at_reader`): C is in neither GEMM's kernel, so the kernel reads a materialized value
  from each, on the device, distinct where the second's path avoids every value made from the
  first. `lower_bound(host_offload=True)` keeps only this form, and no residual stack.
- A free argument/output allocation holds at most one of the buffers counted at a moment, and
  only one no larger than itself (`MaybeAssignBuffer`: a buffer goes whole, at offset 0, into an
  allocation no smaller, whose other buffers' live ranges do not interfere), so a 2 MiB
  activation cannot hide in a 1 MiB parameter's output allocation (`_saving`).
- Which argument/output allocations are surely occupied at the operation: a readonly argument
  (not donated); a donated argument aliased to an output computed from it through same-size
  elementwise steps (an optimizer update `p - lr * u`, a moment `b1 * m + (1 - b1) * g`), as
  at every moment the argument, a step of that chain or the output is live, unless a step of
  that chain is in the operation's own operands (then it is counted free). Every other output
  allocation, and every donated argument with no known alias, may be free: it may hold one
  counted buffer no larger than itself.

Rematerialization adds recomputation and reordering adds barriers; neither removes a scatter,
a GEMM or a convolution of the backward pass, nor makes an argument or output smaller, so the
bound read from the original step holds for them too (checked against XLA:GPU's totals of
several variants in `tests/fit/test_fit_bound.py` and `tests/fit/test_fit_bound_pairs.py`). No
term above counts FLOPs: `lower_bound` is over every policy, whatever it recomputes.

`flop_lower_bound` is over the variants within a FLOP cap (the issue's +15%, counted on the
jaxpr as fit counts it): at the first run of a GEMM/convolution/scatter z (the pivot), every
GEMM d that z is made from and whose result is read again after z's kernel (through a value u
made from d, read by an op made from z outside z's kernel) either runs again, paying its FLOPs,
or has a value on every path from d to u held across that moment, so at least the widest path's
narrowest value. Paths that share no buffer give distinct buffers; what the cap lets a variant
recompute is taken off exactly (`_least_held`). It rests on: XLA runs a dot, convolution or
scatter no more often than the jaxpr has it (no duplication into fusions; its rematerialization
pass runs only under a memory limit, and a deviceless compile has 80 GB), every op of a step
with no `jax.checkpoint` in it runs at least once in any variant, and a GEMM kernel takes no
other GEMM, reduction or scatter (its epilogue is `_region`). A value held across the moment is
taken to be on the device: an offload policy could keep it in host memory instead, so this
term (and the pair term, which holds a value across a GEMM too) claims policies without host
offload, and fit's line says so. Checked against XLA:GPU's totals of variants within the cap in
`tests/fit/test_fit_bound_flops.py`.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.aliasing import donation_aliases
from jaxmem.compiler.plan_types import Const, SourceLine
from jaxmem.compiler.program import Program, drop_dead
# HEROES: operations XLA:GPU never fuses into a consumer as a producer (the table's `hero`
# column): their results are materialized (or take their own fusion's elementwise epilogue).
# Everything else (elementwise, layout, gather, control flow, unknown) is treated as fusible,
# which can only lower the bound. SCATTERS: the heroes that update operand 0 in place.
from jaxmem.compiler.rules import BOUND_VIEWS, DOT_LIKE, HEROES, SCATTERS


@dataclass(frozen=True)
class LowerBound:
    """`bytes` (at least `floor_bytes`): no variant of the step runs below it on XLA:GPU. `op`,
    `source` and `held_bytes`: the operation that sets it and what it must hold (result and
    materialized operands beyond `floor`); `free_bytes`: argument/output allocations it may use."""

    bytes: int
    floor_bytes: int
    op: str = ""
    source: SourceLine | None = None
    held_bytes: int = 0
    free_bytes: int = 0
    other: str = ""                       # a pair: the other operation, and the op reading both
    other_source: SourceLine | None = None
    reader: str = ""
    reader_source: SourceLine | None = None
    flop_cap: float = 0.0                 # > 0: the bound holds for variants within this FLOP cap
    crossings: int = 0                    # that bound: buffers counted at the pivot's kernel
    during: bool = False                  # ... while it runs (its result counted), else as it ends
    loop: str = ""                        # a loop's term: the loop, its state, its body's bound
    loop_source: SourceLine | None = None
    loop_state_bytes: int = 0
    residual_bytes: int = 0               # ... and the residual stack it reads (without offload)
    inner: "LowerBound | None" = None
    at_reader: bool = False               # a pair counted at the op reading both (`_pair_at_reader`)
    host_offload: bool = False            # terms offload escapes left out (`lower_bound(host_offload=True)`)

    def describe(self) -> str:
        from jaxmem.units import format_size

        floor = f"arguments + outputs - aliases {format_size(self.floor_bytes)}"
        what = self._what()
        if not what:
            return floor
        return f"{what}, beside {floor}, of which at most {format_size(self.free_bytes)} may be free then"

    def _what(self) -> str:
        """What the term holds, without the floor (a loop's body term is said inside its loop's)."""
        from jaxmem.units import format_size

        if self.loop:
            at = f" at {self.loop_source}" if self.loop_source is not None else ""
            stack = (f" and the values its iterations saved ({format_size(self.residual_bytes)})"
                     if self.residual_bytes else "")
            inside = self.inner._what() if self.inner is not None else ""
            inside = f"; in an iteration, {inside}" if inside else ""
            return (f"while the {self.loop}{at} runs, it holds its results "
                    f"({format_size(self.loop_state_bytes)}){stack}{inside}")
        if not self.op:
            return ""
        where = f" at {self.source}" if self.source is not None else ""
        if self.flop_cap:
            moment = "while" if self.during else "as"
            ends = "runs first" if self.during else "first ends"
            return (f"{moment} {self.op}{where} {ends}, {self.crossings} buffers made from distinct GEMMs, "
                    f"convolutions or scatters, {format_size(self.held_bytes)}, are live unless their GEMM "
                    f"runs again, and +{self.flop_cap:.0%} FLOPs recompute only part of them")
        if self.other and self.at_reader:
            other = f" at {self.other_source}" if self.other_source is not None else ""
            reader = f" at {self.reader_source}" if self.reader_source is not None else ""
            return (f"{self.reader}{reader} reads values made from {self.op}{where} and from {self.other}{other}: "
                    f"as its kernel runs both are on the device, {format_size(self.held_bytes)}")
        if self.other:
            other = f" at {self.other_source}" if self.other_source is not None else ""
            reader = f" at {self.reader_source}" if self.reader_source is not None else ""
            return (f"{self.reader}{reader} reads both {self.op}{where} and {self.other}{other}: whichever "
                    f"runs later holds its result and a value made from the other's, "
                    f"{format_size(self.held_bytes)}")
        return f"{self.op}{where} must hold {format_size(self.held_bytes)} (its result and materialized operands)"


def _is_hero(op: Any) -> bool:
    if op.primitive == "dot_general":
        # A dot with no contracting dimension is an outer product: XLA rewrites it to a
        # multiply of broadcasts, which fuses like any elementwise op.
        (lhs_contract, _), _ = op.params["dimension_numbers"]
        return len(lhs_contract) > 0
    return op.primitive in HEROES


def _is_output(p: Program) -> list[bool]:
    out = [False] * p.num_values
    for v in p.outvars:
        if not isinstance(v, Const):
            out[v] = True
    return out


def _cut_costs(p: Program, heroes: list[bool], is_out: list[bool]) -> list[int]:
    """Per value: the bytes that must be materialized between the nearest heroes above it and a
    consumer that reads it from memory (the widest path's narrowest value; arguments, outputs
    and constants cost nothing)."""
    cost = [0] * p.num_values
    for op in p.ops:  # ops are in topological order
        above = max((cost[v] for v in op.inputs), default=0)
        for v in op.outputs:
            if v is None:
                continue
            own = 0 if is_out[v] else p.nbytes[v]
            cost[v] = own if heroes[op.index] else min(own, above)
    return cost


def _cone(p: Program, heroes: list[bool], start: Sequence[int]) -> set[int]:
    """The values an operation's fusion could reach through fusible producers from `start`."""
    seen: set[int] = set()
    stack = list(start)
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        made_by = p.producer[v]
        if made_by >= 0 and not heroes[made_by]:
            stack.extend(p.ops[made_by].inputs)
    return seen


def _result_cost(p: Program, op: Any, heroes: list[bool], is_out: list[bool]) -> int:
    """Bytes the operation's result needs in memory: a scatter's own result; a GEMM's or a
    convolution's, or any of its elementwise consumers' (an epilogue), whichever is smallest."""
    outs = [v for v in op.outputs if v is not None]
    if op.primitive in SCATTERS:
        return sum(0 if is_out[v] else p.nbytes[v] for v in outs)
    best = sum(0 if is_out[v] else p.nbytes[v] for v in outs)
    stack, seen = list(outs), set(outs)
    while stack and best:
        v = stack.pop()
        for user in p.users[v]:
            if heroes[user]:
                continue
            for w in p.ops[user].outputs:
                if w is not None and w not in seen:
                    seen.add(w)
                    best = min(best, 0 if is_out[w] else p.nbytes[w])
                    stack.append(w)
    return best


def _chain(p: Program, heroes: list[bool], arg: int, out: int) -> set[int] | None:
    """The values from argument `arg` to output `out` through fusible steps of the same size
    (None when there is no such chain): while the output is not yet made, one of them is live."""
    if out == arg:
        return set()
    size = p.nbytes[arg]
    found: set[int] = set()

    def reaches(v: int, seen: set[int]) -> bool:
        if v == arg:
            return True
        made_by = p.producer[v]
        # A loop reads all of its inputs while it makes its results: not a step of a chain.
        if (v in seen or made_by < 0 or heroes[made_by] or p.nbytes[v] != size
                or p.ops[made_by].primitive in LOOP_BODIES):
            return False
        seen.add(v)
        hit = False
        for u in p.ops[made_by].inputs:
            if reaches(u, seen):
                hit = True
        if hit:
            found.add(v)
        return hit

    return found if reaches(out, set()) else None


def _is_counted_hero(op: Any, heroes: list[bool]) -> bool:
    """A scatter, GEMM or convolution: an operation whose result `_result_cost` bounds."""
    return op.primitive in SCATTERS or (op.primitive in DOT_LIKE and heroes[op.index])


def _allocations(p: Program, heroes: list[bool], aliases: dict[int, int],
                 donors: set[int]) -> tuple[list[int], list[tuple[int, set[int]]]]:
    """(sizes of the argument/output allocations that may be free at any moment, (size, chain)
    of each donated argument kept busy by its same-size chain to its output)."""
    free_always = [p.nbytes[p.invars[a]] for a in donors]
    pinned: list[tuple[int, set[int]]] = []
    for position, out in enumerate(p.outvars):
        size = p.outvar_bytes[position]
        arg = aliases.get(position)
        if isinstance(out, Const) or arg is None:  # its own allocation, free until it is written
            free_always.append(size)
            continue
        chain = _chain(p, heroes, p.invars[arg], out)
        if chain is None:
            free_always.append(size)
        else:
            pinned.append((size, chain))
    return free_always, pinned


def _saving(buffers: Sequence[int], free: Sequence[int]) -> int:
    """The most of `buffers` (bytes counted for distinct buffers live at one moment) that free
    argument/output allocations can hold. XLA's buffer assignment (`MaybeAssignBuffer`) puts a
    buffer into such an allocation only whole, at offset 0, when it is no larger, and only while
    no other buffer assigned there is live: one buffer per allocation at a time. Largest first,
    each into the smallest allocation that takes it, is the best such matching (the allocations
    that take a buffer take every smaller one)."""
    return _matching(buffers, free)[0]


def _matching(buffers: Sequence[int], free: Sequence[int]) -> tuple[int, list[int]]:
    """`_saving`'s matching: (bytes held in free allocations, the allocations left unused)."""
    sizes = sorted(free)
    saved = 0
    for b in sorted((b for b in buffers if b > 0), reverse=True):
        k = bisect.bisect_left(sizes, b)
        if k < len(sizes):
            sizes.pop(k)
            saved += b
    return saved, sizes


def _region(p: Program, op: Any, heroes: list[bool]) -> set[int]:
    """The ops XLA could fuse into `op`'s kernel as its epilogue: non-hero consumers, transitively,
    none of whose operands needs `op`'s result through another hero (a reduction or a dot of it
    cannot finish inside the kernel that is still writing that result)."""
    early: set[int] = {v for v in op.outputs if v is not None}   # made in the kernel
    later: set[int] = set()                                      # made from it, after it
    found: set[int] = set()
    for user in p.ops[op.index + 1:]:  # ops are in topological order
        ins = user.inputs
        if not any(v in early or v in later for v in ins):
            continue
        outs = [v for v in user.outputs if v is not None]
        if not heroes[user.index] and not any(v in later for v in ins):
            found.add(user.index)
            early.update(outs)
        else:
            later.update(outs)
    return found


def _widest(p: Program, starts: Sequence[Any], own: list[int], blocked: set[int]) -> np.ndarray:
    """[op, k]: the largest, over paths from `starts[k]`'s results into the op's operands that
    avoid the `blocked` ops, of the smallest `own` cost on the path (-1 where no such path). One
    pass in topological order, all starts at once."""

    column = {op.index: k for k, op in enumerate(starts)}
    width = np.full((p.num_values, len(starts)), -1, dtype=np.int64)
    into = np.full((len(p.ops), len(starts)), -1, dtype=np.int64)
    for op in p.ops:  # ops are in topological order
        outs = [v for v in op.outputs if v is not None]
        if op.inputs:
            through = width[op.inputs].max(axis=0)
            into[op.index] = through
            if op.index not in blocked:
                for v in outs:
                    width[v] = np.maximum(width[v], np.minimum(through, own[v]))
        k = column.get(op.index)
        if k is not None:
            for v in outs:
                width[v, k] = max(width[v, k], own[v])
    return into


# At most this many pairs get the exact (path-avoiding) evaluation, largest estimate first.
PAIR_EVALUATIONS = 16


def _pair_bound(p: Program, heroes: list[bool], is_out: list[bool], free_always: list[int],
                pinned: list[tuple[int, set[int]]], best: "LowerBound") -> "LowerBound":
    """Two GEMMs/convolutions/scatters d1, d2 whose results both reach one later op C. Whatever
    the policy and order, C reads values made from one instance of each; take the one computed
    later, say d2's. While d2's kernel runs, its result (at least `_result_cost`) is being written,
    and on every path from d1 to C a value made before d2's kernel and read after it is live (the
    widest path's narrowest value). So at that moment both are held, as distinct buffers: the
    path avoids the ops d2's kernel could hold (`_region`), so the value on it is read after d2's
    kernel and cannot be overwritten in place by it (XLA:GPU shares a fusion's output only with an
    operand whose last use it is, `FusionCanShareBufferHint`). Which one is later is not known:
    the bound is the smaller of the two orders."""
    floor = best.floor_bytes
    own = [0 if is_out[v] else p.nbytes[v] for v in range(p.num_values)]
    cands = [op for op in p.ops if _is_counted_hero(op, heroes)]
    if len(cands) < 2:
        return best
    result = np.array([_result_cost(p, op, heroes, is_out) for op in cands], dtype=np.int64)
    # A path's narrowest value is at most the op's own result: a pair holds at most
    # min(size_1 + result_2, size_2 + result_1). Only ops in a pair that could beat `best` go on.
    size = np.array([max((own[v] for v in op.outputs if v is not None), default=0) for op in cands],
                    dtype=np.int64)
    ceiling = np.minimum(size[:, None] + result[None, :], size[None, :] + result[:, None])
    np.fill_diagonal(ceiling, 0)
    keep = np.flatnonzero((floor + ceiling > best.bytes).any(axis=1))
    if len(keep) < 2:
        return best
    cands, result = [cands[k] for k in keep], result[keep]
    # Estimates with paths free to pass anywhere: never below the exact figure.
    reach = _widest(p, cands, own, set()).T          # [k, op]
    estimates: list[tuple[int, int, int]] = []
    ceiling = ceiling[np.ix_(keep, keep)]
    for i in range(len(cands)):
        js = np.flatnonzero(floor + ceiling[i, i + 1:] > best.bytes) + i + 1
        if not len(js):
            continue
        both = (reach[i][None, :] >= 0) & (reach[js] >= 0)
        orders = np.minimum(reach[i][None, :] + result[js][:, None], reach[js] + result[i])
        top = np.where(both, orders, -1).max(axis=1)
        estimates.extend((int(t), i, int(j)) for t, j in zip(top, js) if floor + t > best.bytes)
    estimates.sort(reverse=True)
    regions: dict[int, set[int]] = {}
    avoiding: dict[int, np.ndarray] = {}   # paths that avoid one op's kernel, from every op

    def paths_avoiding(k: int) -> np.ndarray:
        if k not in avoiding:
            avoiding[k] = _widest(p, cands, own, regions[k]).T
        return avoiding[k]

    for estimate, i, j in estimates[:PAIR_EVALUATIONS]:
        if floor + estimate <= best.bytes:
            break
        d1, d2 = cands[i], cands[j]
        for k, d in ((i, d1), (j, d2)):
            if k not in regions:
                regions[k] = _region(p, d, heroes)
        # Paths from one avoid the other's kernel; C is in neither kernel.
        w1, w2 = paths_avoiding(j)[i], paths_avoiding(i)[j]
        skip = regions[i] | regions[j] | {d1.index, d2.index}
        touched = _descendants(p, d1) | _descendants(p, d2)
        free = free_always + [size for size, chain in pinned if chain & touched]
        r1, r2 = int(result[i]), int(result[j])
        ok = (w1 >= 0) & (w2 >= 0)
        ok[list(skip)] = False
        for c in np.flatnonzero(ok)[np.unique(np.stack([w1, w2])[:, ok], axis=1, return_index=True)[1]]:
            a, b = int(w1[c]), int(w2[c])
            later2 = a + r2 - _saving([a, r2], free)   # d2 later: d1's path value and d2's result
            later1 = b + r1 - _saving([b, r1], free)
            held = min(later1, later2)
            if floor + held > best.bytes:
                first, second = (d1, d2) if later2 <= later1 else (d2, d1)
                best = LowerBound(floor + held, floor, second.primitive, second.source,
                                  a + r2 if second is d2 else b + r1, sum(free), other=first.primitive,
                                  other_source=first.source, reader=p.ops[c].primitive,
                                  reader_source=p.ops[c].source)
    return best


def _pair_at_reader(p: Program, heroes: list[bool], is_out: list[bool], free_always: list[int],
                    pinned: list[tuple[int, set[int]]], best: "LowerBound") -> "LowerBound":
    """`_pair_bound`'s two GEMMs/convolutions/scatters d1, d2 read by one later op C, counted where
    no policy can move a value to host memory: at C's own kernel. C is in neither's kernel
    (`_region`), so the kernel reads materialized values made from each, and a kernel reads the
    device's memory (XLA moves an offloaded value back before its reader: the host offloader's
    MoveToDevice). On every path from d1 into C the kernel reads some value of the path, so at
    least the widest path's narrowest value; likewise from d2, over paths that avoid every value
    made from d1, so the two are distinct buffers (one is made from d1, the other not). C's own
    result may be written over either, and is not counted. Recomputation only adds instances, and
    C reads one of each. It holds for offload policies, which `_pair_bound` does not (there, the
    earlier GEMM's value may sit in pinned host memory while the later one writes), and it can
    count more: transformer_train's log-softmax backward reads the cross-entropy scatter's 16 MiB
    and a 16 MiB value made from the logits' GEMM, where `_pair_bound` counts only a narrower
    path's."""
    floor = best.floor_bytes
    own = [0 if is_out[v] else p.nbytes[v] for v in range(p.num_values)]
    cands = [op for op in p.ops if _is_counted_hero(op, heroes)]
    if len(cands) < 2:
        return best
    # A path's narrowest value is at most its hero's own result: a pair holds at most both sizes.
    size = np.array([max((own[v] for v in op.outputs if v is not None), default=0) for op in cands],
                    dtype=np.int64)
    ceiling = size[:, None] + size[None, :]
    np.fill_diagonal(ceiling, 0)
    if not (floor + ceiling > best.bytes).any():
        return best
    anyhow = _widest(p, cands, own, set()).T            # [k, op]: paths from cands[k], anywhere
    # Estimates with both paths free to pass anywhere (never below the exact figure): only pairs
    # that could beat `best` are evaluated, the most promising first.
    reached = np.where(anyhow >= 0, anyhow, -(1 << 60))
    estimates = []
    for i in range(len(cands)):
        if (floor + ceiling[i] > best.bytes).any():
            top = (reached[i][None, :] + reached).max(axis=1)
            top[i] = -1
            estimates.append((int(top.max()), i, top))
    estimates.sort(key=lambda e: -e[0])
    regions: dict[int, set[int]] = {}
    for estimate, i, top in estimates:
        if floor + estimate <= best.bytes:
            break
        d1 = cands[i]
        partners = np.flatnonzero(floor + np.minimum(top, ceiling[i]) > best.bytes)
        if not len(partners):
            continue
        made = _descendants(p, d1)
        partners = [j for j in partners if not any(v in made for v in cands[j].outputs if v is not None)]
        if not partners:
            continue
        # Paths from every other hero that avoid the values made from d1.
        apart = _widest(p, cands, own, {p.producer[v] for v in made}).T
        for j in partners:
            d2 = cands[j]
            for k, d in ((i, d1), (j, d2)):
                if k not in regions:
                    regions[k] = _region(p, d, heroes)
            ok = (anyhow[i] >= 0) & (apart[j] >= 0)
            ok[list(regions[i] | regions[j] | {d1.index, d2.index})] = False
            if not ok.any():
                continue
            touched = made | _descendants(p, d2)
            free = free_always + [size_ for size_, chain in pinned if chain & touched]
            for c in np.flatnonzero(ok)[np.unique(np.stack([anyhow[i], apart[j]])[:, ok], axis=1, return_index=True)[1]]:
                a, b = int(anyhow[i][c]), int(apart[j][c])
                held = a + b - _saving([a, b], free)
                if floor + held > best.bytes:
                    best = LowerBound(floor + held, floor, d1.primitive, d1.source, a + b, sum(free),
                                      other=d2.primitive, other_source=d2.source, reader=p.ops[c].primitive,
                                      reader_source=p.ops[c].source, at_reader=True)
    return best


def _descendants(p: Program, start: Any) -> set[int]:
    """The values computed from `start`'s results."""
    seen: set[int] = set()
    stack = [v for v in start.outputs if v is not None]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        for user in p.users[v]:
            stack.extend(w for w in p.ops[user].outputs if w is not None)
    return seen



# -- a bound over policies within a FLOP cap ----------------------------------------------------

# BOUND_VIEWS: ops whose result XLA may make a view of an operand's buffer (a bitcast, a
# barrier's pass-through, a copy it elides): a value and its view are one buffer, so the
# FLOP-capped bound never counts them as two. Over-joining only weakens the bound.

# How a verdict names the policies it does not cover (fit then measures offload candidates).
WITHOUT_OFFLOAD = "without host offload"

# The cap: at most this fraction of the original's FLOPs recomputed.
FLOP_CAP = 0.15


def _has_remat(jaxpr: Any) -> bool:
    """Whether the jaxpr (nested ones included) already recomputes: a `jax.checkpoint` in it,
    which a policy could weaken, so the original's FLOPs would not be a floor for every variant."""
    from jaxmem.compiler.jaxpr_adapter import jaxpr_eqns, nested_jaxprs

    for eqn in jaxpr_eqns(jaxpr):
        if "remat" in eqn.primitive.name or "checkpoint" in eqn.primitive.name:
            return True
        if any(_has_remat(sub) for sub in nested_jaxprs(eqn)):
            return True
    return False


def _buffer_classes(p: Program) -> tuple[list[int], set[int]]:
    """Per value, a representative of the values XLA may hold in one buffer: views of each other
    (`BOUND_VIEWS`), an elementwise op with a literal operand and its same-size operand (XLA's
    simplifier turns `x * 1`, `x + 0`, `max(x, -inf)` into `x`), and equations that compute the
    same thing from the same buffers (XLA's CSE merges them). Also the ops that are such a
    repeat of an earlier op."""
    parent = list(range(p.num_values))
    twins: set[int] = set()

    def find(v: int) -> int:
        while parent[v] != v:
            parent[v] = parent[parent[v]]
            v = parent[v]
        return v

    def join(a: int, b: int) -> None:
        parent[find(a)] = find(b)

    seen: dict[tuple[Any, ...], list[int | None]] = {}
    for op in p.ops:
        outs = [w for w in op.outputs if w is not None]
        if op.primitive in BOUND_VIEWS:
            for w in outs:
                for v in op.inputs:
                    join(w, v)
        elif any(isinstance(v, Const) for v in op.operands):
            for w in outs:
                for v in op.inputs:
                    if p.nbytes[v] == p.nbytes[w]:
                        join(w, v)
        try:
            key = (op.primitive, str(op.params), tuple(_const_key(v) if isinstance(v, Const) else find(v)
                                                       for v in op.operands))
        except Exception:  # noqa: BLE001 - an unprintable parameter: no CSE key, the op stands alone
            continue
        twin = seen.setdefault(key, op.outputs)
        if twin is not op.outputs:
            twins.add(op.index)
        for a, b in zip(op.outputs, twin):
            if a is not None and b is not None:
                join(a, b)
    return [find(v) for v in range(p.num_values)], twins


def _const_key(c: Const) -> tuple[Any, ...]:
    """A literal's CSE key: its value when small; else only its shape and type, so two large
    constants may be taken as one (which only joins more values)."""
    value = np.asarray(c.val)
    if value.size <= 16:
        return ("c", str(value.dtype), value.shape, value.tobytes())
    return ("c", str(value.dtype), value.shape)


def _ancestor_bits(p: Program) -> list[int]:
    """Per value, a bitset of itself and every value it is computed from."""
    bits = [1 << v for v in range(p.num_values)]
    for op in p.ops:
        above = 0
        for v in op.inputs:
            above |= bits[v]
        for w in op.outputs:
            if w is not None:
                bits[w] |= above
    return bits


def _descendant_bits(p: Program) -> list[int]:
    """Per value, a bitset of itself and every value computed from it."""
    bits = [1 << v for v in range(p.num_values)]
    for op in reversed(p.ops):
        below = 0
        for w in op.outputs:
            if w is not None:
                below |= bits[w]
        for v in op.inputs:
            bits[v] |= below
    return bits


def _fractional_knapsack(items: Sequence[tuple[int, int]], capacity: float) -> float:
    """The most value (bytes) of `items` ((bytes, FLOPs)) whose FLOPs fit `capacity`, items
    divisible: never below the best whole choice, so subtracting it keeps a bound sound."""
    got = 0.0
    free_items = [b for b, f in items if f <= 0]
    got += sum(free_items)
    for b, f in sorted(((b, f) for b, f in items if f > 0), key=lambda t: t[0] / t[1], reverse=True):
        if capacity <= 0:
            break
        take = min(1.0, capacity / f)
        got += take * b
        capacity -= take * f
    return got


# Above this many choices of what to recompute, `_least_held` takes the fractional knapsack.
EXACT_CHOICES = 1000


def _least_held(items: Sequence[tuple[int, float]], allowance: float, free: Sequence[int]) -> int:
    """The fewest bytes a variant holds of `items` ((bytes, FLOPs to make it again), one buffer
    each) when it may recompute items within `allowance` FLOPs and put one held buffer in each
    free allocation no smaller (`_saving`). Exact over every affordable choice (items alike are
    counted, not chosen one by one) while there are few; else the sum less a fractional
    knapsack and the saving of all items (each an overestimate of what it removes)."""
    kinds: dict[tuple[int, float], int] = {}
    for item in items:
        kinds[item] = kinds.get(item, 0) + 1
    kind_list = sorted(kinds, key=lambda k: k[1])
    counts: list[list[int]] = []

    def grow(at: int, left: float, chosen: list[int]) -> bool:
        if at == len(kind_list):
            counts.append(list(chosen))
            return len(counts) <= EXACT_CHOICES
        (_, flops), have = kind_list[at], kinds[kind_list[at]]
        most = have if flops <= 0 else min(have, int(left // flops)) if flops != float("inf") else 0
        for n in range(most + 1):
            chosen.append(n)
            ok = grow(at + 1, left - n * max(flops, 0), chosen)
            chosen.pop()
            if not ok:
                return False
        return True

    if grow(0, allowance, []):
        least = None
        for chosen in counts:
            rest = [k[0] for k, n in zip(kind_list, chosen) for _ in range(kinds[k] - n)]
            held = sum(rest) - _saving(rest, free)
            least = held if least is None else min(least, held)
        return int(least or 0)
    every = [b for b, _ in items]
    return max(0, int(sum(every) - _fractional_knapsack(items, allowance)) - _saving(every, free))


@dataclass(frozen=True)
class _Crossing:
    """A GEMM/convolution/scatter `d` made before the pivot's kernel ends, and a value `u` read
    after it that is computed from `d`: unless `d` runs again (its FLOPs), a value on `path` (a
    bitset of the values on the widest path from d to u, each at least `bytes`) is held across
    that moment."""

    d: int
    u: int
    bytes: int
    path: int
    flops: int


class _Widest:
    """Per value v and GEMM/convolution/scatter d: the widest path from d's results to v (the
    largest, over paths, of the smallest `own` bytes on the path; -1 where v is not made from d),
    and the operand each path comes through, so the path can be read back. One pass over the ops
    in topological order, every d at once."""

    def __init__(self, p: Program, ds: Sequence[int], own: list[int]) -> None:
        self.p, self.ds = p, list(ds)
        self.column = {d: k for k, d in enumerate(self.ds)}
        self.width = np.full((p.num_values, len(self.ds)), -1, dtype=np.int64)
        self.came = np.full((p.num_values, len(self.ds)), -1, dtype=np.int64)
        for op in p.ops:
            outs = [w for w in op.outputs if w is not None]
            k = self.column.get(op.index)
            if op.inputs and outs:
                through = self.width[op.inputs]              # [inputs, ds]
                pick = through.argmax(axis=0)
                best = through[pick, np.arange(len(self.ds))]
                for w in outs:
                    self.width[w] = np.where(best >= 0, np.minimum(best, own[w]), -1)
                    self.came[w] = np.where(best >= 0, np.asarray(op.inputs)[pick], -1)
            if k is not None:
                for w in outs:
                    self.width[w, k] = own[w]
                    self.came[w, k] = -1

    def path(self, d: int, u: int) -> int:
        """The values on the widest path from `d`'s results to `u`, as a bitset."""
        k = self.column[d]
        bits, v = 0, u
        while v >= 0:
            bits |= 1 << v
            v = int(self.came[v, k])
        return bits


def _crossings(p: Program, z: Any, region: set[int], anc: list[int], desc: list[int],
               hero_flops: dict[int, int], widest: _Widest) -> list[_Crossing]:
    """The crossings at pivot `z` (see `_flop_bound`; `region`: the ops its kernel may hold
    besides it), the widest per `d`."""
    z_desc = 0
    for w in z.outputs:
        if w is not None:
            z_desc |= desc[w]
    # Ops surely run after z's kernel: computed from z, and not in its epilogue. (No path into
    # a value they read passes through a value they make: those are all made after the kernel.)
    after_ops = [op for op in p.ops[z.index + 1:] if op.index not in region
                 and any((z_desc >> v) & 1 for v in op.inputs)]
    after = 0
    for op in after_ops:
        for w in op.outputs:
            if w is not None:
                after |= 1 << w
    read_after = sorted({v for op in after_ops for v in op.inputs if not (after >> v) & 1})
    if not read_after:
        return []
    z_anc = 0
    for v in z.inputs:
        z_anc |= anc[v]
    widths = widest.width[read_after]                 # [u, d]
    found: list[_Crossing] = []
    for d_index, flops in hero_flops.items():
        outs = [w for w in p.ops[d_index].outputs if w is not None]
        if d_index != z.index and not any((z_anc >> w) & 1 for w in outs):
            continue
        column = widths[:, widest.column[d_index]]
        pick = int(column.argmax())
        if column[pick] > 0:
            u = read_after[pick]
            found.append(_Crossing(d_index, u, int(column[pick]), widest.path(d_index, u), flops))
    return found


def _family(crossings: Sequence[_Crossing], classes_of: Callable[[int], frozenset[int]]) -> list[_Crossing]:
    """Crossings whose paths share no buffer, largest first: each needs a buffer of its own at the
    pivot (unless its GEMM runs again)."""
    used: set[int] = set()
    chosen: list[_Crossing] = []
    for c in sorted(crossings, key=lambda c: c.bytes, reverse=True):
        mine = classes_of(c.path)
        if mine & used:
            continue
        used |= mine
        chosen.append(c)
    return chosen


def _flop_bound(p: Program, heroes: list[bool], is_out: list[bool], free_always: list[int],
                pinned: list[tuple[int, set[int]]], floor: int, allowance: float,
                cap: float, target: int = 0) -> "LowerBound | None":
    """A bound over the variants that recompute at most `allowance` FLOPs beyond the original's.

    Pick a GEMM/convolution/scatter z (the pivot) and the moment its first instance's kernel
    ends. Take d, a GEMM/convolution/scatter z is computed from (or z itself), and u, a value read
    by an op computed from z outside z's kernel (so it runs after that moment). If u is computed
    from d, then in any variant either d runs twice (its first instance is before the moment, as
    z needs it; extra FLOPs at least d's), or every instance of d is before the moment, and on
    each path from d to u a value is held across it: at least the narrowest value of the widest
    path. Crossings whose widest paths share no buffer (`_buffer_classes`) need distinct buffers,
    so at that moment the variant holds the sum of their sizes, less the ones whose d it
    recomputes within `allowance` and what free argument/output allocations can hold
    (`_least_held`). While z's kernel runs (the second moment tried), its result is written too."""
    from jaxmem.compiler.costs import eqn_cost

    hero_flops = {op.index: eqn_cost(op.eqn).flops for op in p.ops if _is_counted_hero(op, heroes)}
    hero_flops = {k: f for k, f in hero_flops.items() if f > 0}
    if not hero_flops:
        return None
    own = [0 if is_out[v] else p.nbytes[v] for v in range(p.num_values)]
    anc, desc = _ancestor_bits(p), _descendant_bits(p)
    widest = _Widest(p, list(hero_flops), own)
    cls, _ = _buffer_classes(p)

    def classes_of(bits: int) -> frozenset[int]:
        return frozenset(cls[v] for v in _bits(bits))

    best: LowerBound | None = None
    for z in p.ops:
        if z.index not in hero_flops:
            continue
        region = _region(p, z, heroes)
        crossings = _crossings(p, z, region, anc, desc, hero_flops, widest)
        for during in (False, True):
            need = max(best.bytes if best is not None else floor, target) - floor
            found = _at_pivot(p, z, heroes, is_out, crossings, during, classes_of, cls, free_always, pinned,
                              allowance, region, need)
            if found is not None and (best is None or floor + found[0] > best.bytes):
                best = LowerBound(floor + found[0], floor, z.primitive, z.source, found[1], found[2],
                                  flop_cap=cap, crossings=found[3], during=during)
    return best


def _bits(bits: int) -> set[int]:
    """The values in a bitset."""
    out: set[int] = set()
    while bits:
        low = bits & -bits
        out.add(low.bit_length() - 1)
        bits ^= low
    return out


def _at_pivot(p: Program, z: Any, heroes: list[bool], is_out: list[bool], crossings: Sequence[_Crossing],
              during: bool, classes_of: Callable[[int], frozenset[int]], cls: list[int], free_always: list[int],
              pinned: list[tuple[int, set[int]]], allowance: float, region: set[int],
              need: int) -> tuple[int, int, int, int] | None:
    """(bytes held beyond the floor, bytes counted, free bytes, buffers counted) at pivot `z`
    (None where the buffers counted are `need` bytes or fewer, or there are none): just
    after its first kernel ends, or (`during`) while it runs. While it runs, its kernel writes its
    result (at least `_result_cost`; no recompute removes it: this is z's first instance), so that
    buffer counts too, and the crossings of z itself are left out (they may be that buffer), as
    are crossings whose path holds a value z's kernel may write."""
    fixed: list[int] = []
    kernel: set[int] = set()
    if during:
        kernel = {w for w in z.outputs if w is not None}
        for k in region:
            kernel.update(w for w in p.ops[k].outputs if w is not None)
        mine = {cls[w] for w in kernel}
        crossings = [c for c in crossings if c.d != z.index and not (classes_of(c.path) & mine)]
        fixed = [b for b in [_result_cost(p, z, heroes, is_out)] if b > 0]
    family = _family(crossings, classes_of)
    if not family and not fixed:
        return None
    # A donated allocation kept busy by its chain may hold a counted buffer if that buffer may be
    # a step of the chain (see `_allocations`).
    touched = set(kernel)
    for c in family:
        touched |= _bits(c.path)
    free = free_always + [size for size, chain in pinned if chain & touched]
    items = [(c.bytes, float(c.flops)) for c in family] + [(b, float("inf")) for b in fixed]
    if sum(b for b, _ in items) <= need:   # cannot beat what is known already: spare the knapsack
        return None
    return _least_held(items, allowance, free), sum(b for b, _ in items), sum(free), len(items)


def _step_program(fn: Callable[..., Any], args: Sequence[Any], donate_argnums: Sequence[int], traced: Any,
                  floor_bytes: int | None) -> tuple[Program, list[bool], list[bool], dict[int, int], set[int], int]:
    """What both bounds start from: the traced step as one program, its heroes and outputs, its
    aliased outputs and donors, and XLA's floor (counted from the jaxpr where not measured)."""
    p = drop_dead(ja.inline(traced.closed_jaxpr))
    heroes = [_is_hero(op) for op in p.ops]
    is_out = _is_output(p)
    flags = [k in traced.donated for k in range(len(p.invars))]
    # constants returned count: JAX pairs every output, XLA writes a returned constant too
    pairing = donation_aliases(p, flags, constant_outputs=True)
    aliases, donors = pairing.outputs, set(pairing.donors)
    if floor_bytes is None:
        used = sum(p.nbytes[v] for v in p.invars if p.users[v] or is_out[v])
        # Several outputs: XLA's output also holds the tuple's table of pointers (8 bytes each).
        table = 8 * len(p.outvars) if len(p.outvars) > 1 else 0
        floor_bytes = used + sum(p.outvar_bytes) + table - sum(p.outvar_bytes[o] for o in aliases)
    return p, heroes, is_out, aliases, donors, floor_bytes


def _program_bound(p: Program, heroes: list[bool], is_out: list[bool], free_always: list[int],
                   pinned: list[tuple[int, set[int]]], floor_bytes: int, host_offload: bool = False) -> LowerBound:
    """The one-op, pair and loop terms over one program (a step, or a loop's body with `floor`
    0: its inputs and outputs are the loop's state, counted by the loop term). `host_offload`:
    only terms that hold for offload policies too (the one-op term does as it is: an offloaded
    operand is back on the device when the op reads it)."""
    cost = _cut_costs(p, heroes, is_out)
    best = LowerBound(floor_bytes, floor_bytes)
    for op in p.ops:
        if not _is_counted_hero(op, heroes):
            continue
        operands = [v for k, v in enumerate(op.operands)
                    if not isinstance(v, Const) and not (op.primitive in SCATTERS and k == 0)]
        # What enters the op's fusion: a cut above each operand (through its fusible producers).
        reach = [cost[v] for v in operands]
        buffers = [_result_cost(p, op, heroes, is_out), max(reach, default=0)]
        if sum(buffers) + floor_bytes <= best.bytes:
            continue
        cone = _cone(p, heroes, operands)
        free = free_always + [size for size, chain in pinned if chain & cone]
        saved = _saving(buffers, free)
        total = floor_bytes + sum(buffers) - saved
        if total > best.bytes:
            best = LowerBound(total, floor_bytes, op.primitive, op.source, sum(buffers), sum(free))
    if not host_offload:
        best = _pair_bound(p, heroes, is_out, free_always, pinned, best)
    best = _pair_at_reader(p, heroes, is_out, free_always, pinned, best)
    return _loop_bound(p, is_out, free_always, pinned, best, host_offload)


# Loops whose body the loop term reads: `lax.scan` and `lax.while_loop` (`fori_loop`).
LOOP_BODIES = {"scan": "jaxpr", "while": "body_jaxpr"}


def _loop_state(p: Program, op: Any, is_out: list[bool]) -> list[int]:
    """Bytes of the loop's results that every variant's loop makes and holds while it runs: its
    carries and stacked outputs (a while loop's state, in one buffer each from before its first
    iteration to after its last), except those another loop reads (a residual stack, which a
    policy changes) and the step's own outputs (in `floor`)."""
    held = []
    for v in op.outputs:
        if v is None or is_out[v]:
            continue
        if any(p.ops[u].primitive in LOOP_BODIES for u in p.users[v]):
            continue
        held.append(p.nbytes[v])
    return held


def _body_program(op: Any) -> Program | None:
    body = op.eqn.params.get(LOOP_BODIES[op.primitive])
    return None if body is None else drop_dead(ja.inline(body))


def _body_bound(bp: Program, host_offload: bool = False) -> LowerBound:
    """The bound over a loop's body as a program of its own: its inputs (the state, the slices
    of stacked inputs) and outputs cost nothing; what its heaviest kernel must hold beside them."""
    return _program_bound(bp, [_is_hero(o) for o in bp.ops], _is_output(bp), [], [], 0, host_offload)


def _carry_stacks(p: Program, op: Any) -> list[int] | None:
    """The body inputs of scan `op` that are slices of a stack another scan made of its carried
    inputs (a backward scan reading the forward's per-iteration inputs, as it does under
    `jax.checkpoint` on the body, and recomputing the rest from them). None where some other
    temporary feeds the loop, whose per-iteration content is not known."""
    if op.primitive != "scan":
        return None
    found = []
    for k, v in enumerate(op.operands):
        if isinstance(v, Const) or p.producer[v] < 0:
            continue                                        # a literal, or the step's argument
        if k < op.params["num_consts"] + op.params["num_carry"]:
            if p.ops[p.producer[v]].primitive in LOOP_BODIES and k < op.params["num_consts"]:
                return None                                 # a loop's result read whole
            continue
        made = p.ops[p.producer[v]]
        if made.primitive != "scan":
            return None
        j = made.outputs.index(v)
        body = made.params["jaxpr"].jaxpr
        first = made.params["num_consts"]
        carried = body.invars[first:first + made.params["num_carry"]]
        if j < made.params["num_carry"] or not any(body.outvars[j] is c for c in carried):
            return None
        found.append(k)
    return found


def _residual_stack(p: Program, op: Any, bp: Program) -> tuple[int, int]:
    """(iterations, bytes per iteration) of the residuals the loop holds in every variant without
    host offload, where it reads the forward scan's carried inputs (`_carry_stacks`); else 0s.

    Whatever the policy, JAX's scan hands its backward what an iteration saved as a stack (one
    buffer, live for the whole backward loop), and the backward's own ops (those reading a
    cotangent, which every variant runs) get the forward values they read from that iteration's
    saved values. So the saved values meet every path from the carried input to such an op's
    operand, and hold at least the widest path's narrowest value per iteration."""
    found = _carry_stacks(p, op)
    if not found:
        return 0, 0
    width = [-1] * bp.num_values
    for k in found:
        width[bp.invars[k]] = bp.nbytes[bp.invars[k]]
    # The backward's own ops: those computed from its carry (the cotangent flowing back).
    backward = [False] * bp.num_values
    first = op.params["num_consts"]
    for k in range(first, first + op.params["num_carry"]):
        if not isinstance(op.operands[k], Const):
            backward[bp.invars[k]] = True
    per_iteration = 0
    for o in bp.ops:
        through = max((width[v] for v in o.inputs), default=-1)
        if any(backward[v] for v in o.inputs):
            per_iteration = max(per_iteration, through)
        for w in o.outputs:
            if w is None:
                continue
            backward[w] = any(backward[v] for v in o.inputs)
            width[w] = min(through, bp.nbytes[w]) if through >= 0 else -1
    return int(op.params["length"]), per_iteration


def _loop_bound(p: Program, is_out: list[bool], free_always: list[int],
                pinned: list[tuple[int, set[int]]], best: LowerBound, host_offload: bool = False) -> LowerBound:
    """While a loop runs, its state is held (`_loop_state`: the backward scan's stacked weight
    gradients and its carried gradient), and inside an iteration its body's heaviest kernel holds
    what `_body_bound` finds, in buffers of the body's own (XLA's while body shares buffers with
    the state only where a value is the state: a body input or output, counted free in the
    body). Policies change what the body recomputes and what the loop reads from a residual
    stack, not the state; a value the body's bound counts is, in a variant that saves it, a slot
    of that stack instead, a buffer of at least the same size. Where the loop reads the forward
    scan's carried inputs, its residual stack is held too (`_residual_stack`, without host
    offload): the other iterations' slots, and the running one's or the body's buffers,
    whichever is more (the body's may be in that slot). Free argument/output allocations may
    hold state buffers (one each) and at most their bytes of the body's. With `host_offload`
    the stack is not counted (an offload policy keeps it in pinned host memory, as MaxText's
    offloaded decoder inputs), nor is any term of the body that offload escapes; the state
    stays: no policy offloads what the loop computes, only what it saves."""
    floor = best.floor_bytes
    for op in p.ops:
        if op.primitive not in LOOP_BODIES:
            continue
        bp = _body_program(op)
        if bp is None:
            continue
        state = _loop_state(p, op, is_out)
        inner = _body_bound(bp, host_offload)
        iterations, slot = (0, 0) if host_offload else _residual_stack(p, op, bp)
        others = max(iterations - 1, 0) * slot
        running = max(slot, inner.bytes)
        if floor + sum(state) + others + running <= best.bytes:
            continue
        touched = {v for v in op.outputs if v is not None} | set(op.inputs)
        free = free_always + [size for size, chain in pinned if chain & touched]
        saved, left = _matching(state + [others], free)
        saved += min(running, sum(left))         # the body's buffers are not known one by one
        total = floor + sum(state) + others + running - saved
        if total > best.bytes:
            best = LowerBound(total, floor, inner.op, inner.source, sum(state) + others + running,
                              sum(free), loop=op.primitive, loop_source=op.source,
                              loop_state_bytes=sum(state), residual_bytes=iterations * slot, inner=inner,
                              host_offload=host_offload)
    return best


def lower_bound(fn: Callable[..., Any], args: Sequence[Any], donate_argnums: Sequence[int] = (),
                floor_bytes: int | None = None, host_offload: bool = False) -> LowerBound:
    """A lower bound on XLA:GPU's total for `fn(*args)` under any rematerialization or order;
    with `host_offload`, also under policies that offload to pinned host memory (never higher:
    the terms that hold a value across a moment, which offload escapes, are left out, and a
    pair of GEMMs is counted only where the op reading both runs, `_pair_at_reader`).

    >>> lower_bound(step, args, donate_argnums=(0, 1)).bytes   # doctest: +SKIP

    Args:
        fn, args, donate_argnums: the step, its example arguments and donated positions.
        floor_bytes: XLA's arguments + outputs - aliases, where measured (else counted here from
            the jaxpr and JAX's lowering).
        host_offload: count only terms that offload policies cannot escape.
    """
    return _bound_of(_prepared(fn, args, donate_argnums, floor_bytes), host_offload)


def _prepared(fn: Callable[..., Any], args: Sequence[Any], donate_argnums: Sequence[int],
              floor_bytes: int | None) -> tuple[Any, ...]:
    """The step's program and what the bound reads of it, traced once for both bounds."""
    traced = ja.trace(fn, tuple(args), {}, tuple(donate_argnums))
    p, heroes, is_out, aliases, donors, floor_bytes = _step_program(fn, args, donate_argnums, traced, floor_bytes)
    free_always, pinned = _allocations(p, heroes, aliases, donors)
    return p, heroes, is_out, free_always, pinned, floor_bytes


def _bound_of(prepared: tuple[Any, ...], host_offload: bool) -> LowerBound:
    bound = _program_bound(*prepared, host_offload)
    return dataclasses.replace(bound, host_offload=host_offload)


def flop_lower_bound(fn: Callable[..., Any], args: Sequence[Any], donate_argnums: Sequence[int] = (),
                     floor_bytes: int | None = None, cap: float = FLOP_CAP,
                     target: int = 0) -> LowerBound | None:
    """A lower bound on XLA:GPU's total for `fn(*args)` under any rematerialization that adds at
    most `cap` of the original's FLOPs (as fit counts them, on the jaxpr), and any order; None
    where the step already recomputes (a `jax.checkpoint` in it: a variant could recompute less
    than the original, so the original's FLOPs are no floor). Never below `lower_bound`'s floor.
    `target`: moments that cannot bound above it are skipped (fit asks only whether the budget is
    exceeded), so a lower figure may come back; it is a bound all the same."""
    from jaxmem.compiler.costs import eqn_cost, jaxpr_flops

    traced = ja.trace(fn, tuple(args), {}, tuple(donate_argnums))
    if _has_remat(traced.closed_jaxpr.jaxpr):
        return None
    p, heroes, is_out, aliases, donors, floor_bytes = _step_program(fn, args, donate_argnums, traced, floor_bytes)
    # Every op of the step runs at least once in any variant (dead code and repeats of one
    # computation aside: a rebuilt variant may drop them); the FLOPs left for running some again
    # are the cap over the original's count less what the ops cost once.
    original = jaxpr_flops(traced.closed_jaxpr.jaxpr)
    _, repeats = _buffer_classes(p)
    once = sum(eqn_cost(op.eqn).flops for op in p.ops if op.index not in repeats)
    allowance = (1 + cap) * original - once
    free_always, pinned = _allocations(p, heroes, aliases, donors)
    return _flop_bound(p, heroes, is_out, free_always, pinned, floor_bytes, allowance, cap, target)


def infeasible_line(budget: int, bound: LowerBound, judge: str) -> str | None:
    """The verdict's line when the bound proves the budget infeasible (within the bound's FLOP
    cap, where it has one)."""
    if bound.bytes <= budget:
        return None
    from jaxmem.units import format_size

    which = "any checkpoint policy, host offload included, or order"
    if offload_may_escape(bound):
        # Values held across a moment may instead sit in host memory under an offload policy
        # (`save_and_offload_only_these_names`): these terms do not count that case. The
        # one-op term does: an offloaded operand is back on the device when the op reads it.
        which = f"any checkpoint policy {WITHOUT_OFFLOAD}, or order"
    if bound.flop_cap:
        which += f", with at most +{bound.flop_cap:.0%} FLOPs"
    return (f"infeasible: lower bound {format_size(bound.bytes)} > budget {format_size(budget)} "
            f"({judge}, {which}: {bound.describe()})")


def offload_may_escape(bound: LowerBound) -> bool:
    """Whether the bound counts a value held across a moment, which an offload policy could keep
    in pinned host memory instead (the pair, residual-stack and FLOP-cap terms)."""
    def held_across(b: LowerBound) -> bool:
        return bool(b.other) and not b.at_reader

    return bool(bound.flop_cap or bound.residual_bytes or held_across(bound)
                or (bound.inner is not None and held_across(bound.inner)))


def verdict(fn: Callable[..., Any], args: Sequence[Any], donate_argnums: Sequence[int], budget: int,
            floor_bytes: int, judge: str) -> str | None:
    """fit's hook: the infeasibility line for an XLA:GPU judge, or None (the bound does not
    exceed the budget, or it could not be read: the search then runs as before). Where the bound
    rests on terms an offload policy could escape, the offload-proof bound is tried too, and
    its line (which claims more) is given where it also exceeds the budget."""
    try:
        prepared = _prepared(fn, args, donate_argnums, floor_bytes)
        bound = _bound_of(prepared, False)
        if bound.bytes > budget and offload_may_escape(bound):
            offloaded = _bound_of(prepared, True)
            if offloaded.bytes > budget:
                bound = offloaded
    except Exception:  # noqa: BLE001 - a bound is an extra proof; its failure must not stop fit
        return None
    return infeasible_line(budget, bound, judge)


def capped_verdict(fn: Callable[..., Any], args: Sequence[Any], donate_argnums: Sequence[int], budget: int,
                   floor_bytes: int, judge: str, cap: float = FLOP_CAP) -> str | None:
    """fit's second hook: the line proving the budget infeasible for every policy and order within
    `cap` extra FLOPs (the issue's criterion), or None. A variant above the cap may still meet it."""
    try:
        bound = flop_lower_bound(fn, args, donate_argnums, floor_bytes, cap, target=budget)
    except Exception:  # noqa: BLE001 - as in `verdict`
        return None
    return None if bound is None else infeasible_line(budget, bound, judge)


__all__ = ["LowerBound", "lower_bound", "flop_lower_bound", "infeasible_line", "offload_may_escape", "verdict", "capped_verdict",
           "WITHOUT_OFFLOAD"]
