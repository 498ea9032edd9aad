"""The fusion model: which intermediates XLA-style fusion never stores.

A fused value has no buffer; the executor computes it as a transient right before each of its
consumers runs, so the fused value's own inputs must stay live until its last consumer. That
is the cost: fusing a cheap elementwise/broadcast producer removes its bytes from memory, but
may keep its (possibly large) inputs alive longer. `choose_fusion` decides value by value, in
program order, by the effect on the peak of the live-bytes profile under a given schedule.

    >>> from jaxmem.compiler.doc_example import sin_program
    >>> program, roles, order = sin_program()   # values 0 (x), 1 (sin x), 2 (the output); x is external
    >>> fused = choose_fusion(program, order, roles, forced_fusion(program, roles))
    >>> fused   # sin(x) is never stored: `mul` recomputes it
    [False, True, False]
    >>> fusion_of(program, fused).reads   # what each op really reads once fusion is applied
    [[], [0]]
"""

from __future__ import annotations

import numpy as np

from jaxmem.compiler.program import DROPPED, Program, side_table
from jaxmem.compiler.rules import DOT_LIKE, MAX_FUSED_READERS, RULES, UNKNOWN, fusible_producer, is_view
from jaxmem.compiler.stages import Fusion, Roles, align, live_profile


def forced_fusion(g: Program, roles: Roles) -> list[bool]:
    """Views of values with no arena buffer (non-donated arguments, other such views) need no
    storage of their own: they are fused unconditionally (unless they are program outputs)."""
    external, outputs = roles.external, roles.outputs
    fused = [False] * g.num_values
    views = side_table(g, "views", op_views)
    for k, op in enumerate(g.ops):
        if not views[k] or len(op.outputs) != 1:
            continue
        out = op.outputs[0]
        src = op.inputs[0] if op.inputs else None
        if out is None or src is None or outputs[out]:
            continue
        if external[src] or fused[src]:
            fused[out] = True
    # An unused value (not an output) needs no storage at all.
    for op in g.ops:
        for v in op.outputs:
            if v is not None and not g.users[v] and not outputs[v] and not op.effectful:
                if fusible_producer(op.primitive, op.params) and len(op.outputs) == 1:
                    fused[v] = True
    return fused


# Elementwise ops a GEMM can apply to its own result before writing it (XLA:GPU's Triton GEMM
# fusions with an epilogue; read from the dump of a scan's gradient, where the weight gradient
# accumulates as `acc + dot(h, dgh)` in one `gemm_fusion_dot` written over `acc`).
EPILOGUE_CONSUMERS = frozenset({"add", "add_any"})


def gemm_epilogues(g: Program, roles: Roles, fused: list[bool]) -> list[bool]:
    """`fused` with every GEMM result that only an elementwise sum reads fused into that sum: the
    GEMM adds the other operand in its epilogue and writes the sum straight out, so its own
    result is never stored (an accumulated gradient, `acc + x.T @ dy`, in place of `acc`). A
    transpose of the GEMM's result in between is folded into the GEMM, as XLA does.

    A base fusion for GPU targets, applied after the target's own rules (`plan_jaxpr`'s
    `base_fusion`); the sum itself stays stored (`choose_fusion` never fuses an op reading a
    fused GEMM), and the sum is written over its other operand only (`liveness`).

    **Arguments:** the program, the values' roles, the fused flags so far.

    **Returns:** a new list of fused flags.
    """
    out = list(fused)
    for op in g.ops:
        if op.primitive not in EPILOGUE_CONSUMERS or len(op.outputs) != 1 or op.outputs[0] is None:
            continue
        w = op.outputs[0]
        if out[w]:
            continue
        for v in op.inputs:
            chain = _gemm_chain(g, roles, out, v)
            if chain and g.shapes[v] == g.shapes[w] and op.operands.count(v) == 1:
                for u in chain:
                    out[u] = True
                break  # one GEMM per sum
    return out


def _gemm_chain(g: Program, roles: Roles, fused: list[bool], v: int) -> list[int]:
    """[the transpose, the GEMM's result] that make `v` (a transpose only where `v` is one),
    when each has one reader and the GEMM's result is stored now; else []."""
    chain = []
    while True:
        prod = g.producer[v]
        if prod < 0 or roles.outputs[v] or roles.external[v] or len(g.users[v]) != 1:
            return []
        if fused[v] and g.ops[prod].primitive in DOT_LIKE:
            return []  # already computed inside its reader
        op = g.ops[prod]
        if len(op.outputs) != 1:
            return []
        chain.append(v)
        if op.primitive in DOT_LIKE:
            return chain
        if op.primitive != "transpose" or len(chain) > 1:
            return []
        v = op.inputs[0]


def reads_fused_gemm(g: Program, fused: list[bool], op) -> bool:
    """Whether `op` computes a fused GEMM result itself (`gemm_epilogues`), maybe transposed, or
    through fused elementwise ops (the GPU prediction's epilogue chains,
    `xla.gpu.model.fusion_gemm.gemm_output_epilogues`): its output is written while the GEMM reads its operands."""
    return any(fused[u] and g.producer[u] >= 0 and _fused_gemm_under(g, fused, u, EPILOGUE_DEPTH)
               for u in op.inputs)


# how many fused elementwise ops `reads_fused_gemm` looks through to find a fused GEMM
EPILOGUE_DEPTH = 4


def _fused_gemm_under(g: Program, fused: list[bool], u: int, depth: int) -> bool:
    prod = g.ops[g.producer[u]]
    if prod.primitive == "transpose" and prod.inputs and fused[prod.inputs[0]]:
        prod = g.ops[g.producer[prod.inputs[0]]]
    if prod.primitive in DOT_LIKE:
        return True
    if depth <= 0 or RULES.get(prod.primitive, UNKNOWN).cost != "elementwise":
        return False
    return any(fused[w] and g.producer[w] >= 0 and _fused_gemm_under(g, fused, w, depth - 1) for w in prod.inputs)


def op_is_view(g: Program, op) -> bool:
    """Whether an op only reinterprets its first operand's bytes (`rules.is_view`)."""
    in_dtype = g.dtypes[op.inputs[0]] if op.inputs else None
    return is_view(op.primitive, op.params, in_dtype)


def op_views(g: Program) -> list[bool]:
    """`op_is_view` of every op, in op order (a `program.side_table`)."""
    return [op_is_view(g, op) for op in g.ops]


def expanded_inputs(g: Program, fused: list[bool], memo: dict[int, list[int]], v: int) -> list[int]:
    """The stored values a fused value `v` is computed from (through chains of fused values).

    Iterative, since elementwise chains thousands of ops long fuse into one.
    """
    got = memo.get(v)
    if got is not None:
        return got
    stack = [v]
    while stack:
        w = stack[-1]
        if w in memo:
            stack.pop()
            continue
        ins = g.ops[g.producer[w]].inputs
        pending = [u for u in ins if fused[u] and u not in memo]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        result: dict[int, None] = {}
        for u in ins:
            if fused[u]:
                for x in memo[u]:
                    result[x] = None
            else:
                result[u] = None
        memo[w] = list(result)
    return memo[v]


def fusion_of(g: Program, fused: list[bool]) -> Fusion:
    """The `Fusion` analysis for these fused flags."""
    return Fusion(fused, expanded_reads(g, fused))


def expanded_reads(g: Program, fused: list[bool]) -> list[list[int]]:
    """Per op, the stored values it reads once fused operands are computed inside it.
    An op all of whose outputs are fused reads nothing itself (its consumers do). Computed once
    per program and fused flags (the planner asks again for the candidates it re-scores): the
    lists are shared, read-only."""
    return side_table(g, ("reads", bytes(fused)), lambda g: _expanded_reads(g, fused))


def _expanded_reads(g: Program, fused: list[bool]) -> list[list[int]]:
    # One forward pass (ops are in dependency order): an op's stored reads are also what each
    # of its fused outputs is computed from, so each fused value's list is ready before any
    # reader asks for it.
    expanded: dict[int, list[int]] = {}   # fused value -> the stored values it is computed from
    memo: dict[int, list[int]] = {}       # the rare fused value made by no op (`expanded_inputs`)
    reads: list[list[int]] = []
    for op in g.ops:
        ins = op.inputs
        for u in ins:
            if fused[u]:
                break
        else:
            merged = list(ins)  # nothing fused: the operands themselves
            for v in op.outputs:
                if v is not None and fused[v]:
                    expanded[v] = merged
            reads.append([] if _all_fused(op.outputs, fused) else merged)
            continue
        result: dict[int, None] = {}
        for u in ins:
            if fused[u]:
                got = expanded.get(u)
                for w in (got if got is not None else expanded_inputs(g, fused, memo, u)):
                    result[w] = None
            else:
                result[u] = None
        merged = list(result)
        for v in op.outputs:
            if v is not None and fused[v]:
                expanded[v] = merged
        # an op all of whose outputs are fused reads nothing itself (its consumers do)
        reads.append([] if _all_fused(op.outputs, fused) else merged)
    return reads


def _all_fused(outputs: list, fused: list[bool]) -> bool:
    """Some output, and every one fused (None: a dropped output)."""
    some = False
    for v in outputs:
        if v is not None:
            if not fused[v]:
                return False
            some = True
    return some


def choose_fusion(g: Program, order: list[int], roles: Roles, base: list[bool]) -> list[bool]:
    """Fuse cheap producers one by one where the peak of live bytes does not rise.

    **Arguments:** the program, a schedule (op indices), the values' roles, and the fusion
    already forced (`forced_fusion`).

    **Returns:** per value, True when it is fused (kept out of memory).
    """
    external, outputs = roles.external, roles.outputs
    fused = list(base)
    n = len(order)
    pos = [0] * len(g.ops)
    for p, oi in enumerate(order):
        pos[oi] = p
    reads = expanded_reads(g, fused)
    size = [align(b) for b in g.nbytes]
    last = [-1] * g.num_values
    start = [-1] * g.num_values
    for v in range(g.num_values):
        p = g.producer[v]
        if p >= 0:
            start[v] = last[v] = pos[p]
    for p, oi in enumerate(order):
        for u in reads[oi]:
            last[u] = p
    for v in range(g.num_values):
        if outputs[v]:
            last[v] = n
    # Live bytes over positions -1..n (index p+1), values counted individually.
    live = live_profile(((start[v], last[v], size[v]) for v in range(g.num_values)
                         if not (external[v] or fused[v] or g.producer[v] == DROPPED)), n)
    peak = int(live.max()) if len(live) else 0
    at_peak = int(np.count_nonzero(live == peak))   # positions holding the peak
    memo: dict[int, list[int]] = {}
    candidates = side_table(g, "fusion candidates", _candidates)
    ops = g.ops
    for oi in order:
        if not candidates[oi]:
            continue
        op = ops[oi]
        v = op.outputs[0]
        if fused[v] or outputs[v]:
            continue
        if op.primitive == "transpose" and any(fused[u] for u in op.inputs):
            continue  # a dot reads a transposed operand, not a recomputed one
        if reads_fused_gemm(g, fused, op):
            continue  # a GEMM's epilogue is stored where the GEMM writes it
        ins = _inputs_now(g, fused, memo, v)
        end = last[v]
        lo, hi = start[v] + 1, end + 1
        sv = size[v]
        # inputs whose life fusing v extends to v's last reader
        grow = [u for u in ins if not external[u] and last[u] < end]
        width = hi + 1 - lo
        if 0 < width <= SHORT_WINDOW and all(last[u] + 2 >= lo for u in grow):
            # Most windows span a few steps: plain Python beats numpy's per-call cost there.
            # The same sums as the general case below, and the peak is kept by counting the
            # positions that hold it (a window never rises above it).
            old = live[lo: hi + 1].tolist()
            new = [x - sv for x in old]
            for u in grow:
                su = size[u]
                for k in range(last[u] + 2 - lo, width):
                    new[k] += su
            if max(new) > peak:
                continue
            fused[v] = True
            live[lo: hi + 1] = new
            for u in grow:
                last[u] = end
            at_peak += new.count(peak) - old.count(peak)
            if at_peak == 0:  # fusing lowered the peak
                peak = int(live.max())
                at_peak = int(np.count_nonzero(live == peak))
            continue
        window = live[lo: hi + 1].copy()
        window -= sv
        for u in grow:
            window[max(last[u] + 2 - lo, 0):] += size[u]
        if window.size and int(window.max()) > peak:
            continue
        fused[v] = True
        live[lo: hi + 1] -= sv
        for u in grow:
            live[last[u] + 2: hi + 1] += size[u]
            last[u] = end
        peak = int(live.max())  # fusing may have lowered it
        at_peak = int(np.count_nonzero(live == peak))
    return fused


# Windows (steps a fused value's inputs must stay live for) up to this long are scored in
# plain Python in `choose_fusion`; longer ones with numpy.
SHORT_WINDOW = 32


def _candidates(g: Program) -> list[bool]:
    """Per op, whether `choose_fusion` may consider fusing its result at all, whatever is fused
    already: a cheap fusible producer of one value, read by few ops that can each compute it."""
    out = []
    for op in g.ops:
        ok = (len(op.outputs) == 1 and op.outputs[0] is not None and fusible_producer(op.primitive, op.params)
              and len(g.users[op.outputs[0]]) <= MAX_FUSED_READERS)
        out.append(ok and all(_absorbs(op.primitive, g.ops[c].primitive) for c in g.users[op.outputs[0]]))
    return out


def _absorbs(producer: str, consumer: str) -> bool:
    """Whether `consumer` can compute a fused `producer` value itself. Transposes fold into
    dot/conv operands (XLA's transpose folding); the rest into loop fusions and reductions."""
    if RULES.get(producer, UNKNOWN).fusion == "transpose":
        return consumer in DOT_LIKE
    return RULES.get(consumer, UNKNOWN).absorbs


def _inputs_now(g: Program, fused: list[bool], memo: dict[int, list[int]], v: int) -> list[int]:
    """Stored inputs of v if it were fused now (its inputs' fusion is already final)."""
    result: dict[int, None] = {}
    for u in g.ops[g.producer[v]].inputs:
        if fused[u]:
            for w in expanded_inputs(g, fused, memo, u):
                result[w] = None
        else:
            result[u] = None
    return list(result)
