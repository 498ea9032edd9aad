"""The Triton softmax rules of the XLA:GPU model's fusion pass (softmax_rewriter_triton.cc):
which row-normalisation values XLA:GPU's softmax rewriter stores as a Triton fusion's output
and which it computes inside the fusion.

`softmax_fusions` and `widened_softmax_roots_stored` are the rules registered in
`fusion.FUSION_RULES`; `softmax_outputs` is also read by the heap pass (a Triton
fusion's output never takes over an operand's buffer).
"""

from __future__ import annotations

from typing import Any

from jaxmem.compiler.program import Program
from jaxmem.compiler.rules import GPU_BITCASTS, GPU_ROW_PASS
from jaxmem.xla.gpu.model.ops import ELEMENTWISE, REDUCTIONS, FusionContext, float_bytes


def softmax_fusions(ctx: FusionContext, fused: list[bool]) -> dict[int, bool]:
    """A softmax-like diamond (a row reduction broadcast back into elementwise ops on the same
    rows: softmax, log-softmax, layer norm) is one Triton fusion
    (xla/service/gpu/transforms/softmax_rewriter_triton.cc): its values read outside it are
    its outputs, stored (`softmax_outputs`); the others are computed inside it."""
    roles = ctx.roles
    stored, inside = softmax_outputs(ctx.g, internal=True)
    changes = {v: False for v in stored if not roles.external[v]}
    changes.update({v: True for v in inside if not (roles.outputs[v] or roles.external[v])})
    return changes


def widened_softmax_roots_stored(ctx: FusionContext, fused: list[bool]) -> dict[int, bool]:
    """With a device: a row-normalised value over a narrow input widened first, read by several
    ops, is the Triton softmax fusion's output, stored in the wide type
    (softmax_rewriter_triton.cc; `widened_softmax_roots`)."""
    if ctx.device is None:
        return {}
    return {v: False for v in widened_softmax_roots(ctx.g) if not ctx.roles.external[v]}


def widened_softmax_roots(g: Program) -> list[int]:
    """Row-normalised values `f32(x) - max(f32(x))` over a narrow `x`, read by several ops: stored.

    XLA:GPU's softmax rewriter makes a Triton fusion of the diamond (the widening convert, the
    row max, its broadcast, the subtract); the diamond's root with several readers ends the
    fusion, so that root is its output, stored in the wide type, and the narrow input dies
    there. Log-softmax over bfloat16 logits: the backward reads the float32 shifted logits
    (`exp(shifted)`), so XLA holds them, twice the bytes of the bfloat16 GEMM result the model
    would otherwise keep (bf16_train's dump: `triton_softmax.13`, f32[4,256,8192], read by the
    sum's reduction, the loss's gather and the gradient's `loop_convert_fusion`;
    `tests/gpu/fusion_programs.py:bf16_log_softmax_grad`). Over a value already in the wide
    type the root and its input have the same bytes, and the existing softmax rule stands.
    """
    out = []
    for op in g.ops:
        if op.primitive != "sub" or len(op.inputs) != 2 or len(op.outputs) != 1 or op.outputs[0] is None:
            continue
        v = op.outputs[0]
        full, row = op.inputs
        if g.shapes[full] != g.shapes[v] or len(g.users[v]) < 2:
            continue
        # the row value: a max reduction over `full`'s last dimension, through broadcasts,
        # reshapes and `stop_gradient` (and the `max(m, -inf)` guard JAX's log_softmax adds)
        r = g.producer[row]
        while r >= 0 and g.ops[r].primitive in GPU_ROW_PASS and len(g.ops[r].inputs) == 1:
            r = g.producer[g.ops[r].inputs[0]]
        if r < 0 or g.ops[r].primitive != "reduce_max" or not g.ops[r].inputs:
            continue
        axes = tuple(g.ops[r].params.get("axes") or ())
        if len(g.shapes[full]) - 1 not in axes:
            continue
        if g.ops[r].inputs[0] != full:
            continue
        c = g.producer[full]
        if c < 0 or g.ops[c].primitive != "convert_element_type" or not g.ops[c].inputs:
            continue
        src = g.ops[c].inputs[0]
        if 0 < float_bytes(g.dtypes[src]) < float_bytes(g.dtypes[full]) and _read_outside_rows(g, v):
            out.append(v)
    return out


def _row_reduction(g: Program, u: int) -> int:
    """The reduction op a row value `u` comes from, through broadcasts, reshapes and unary
    elementwise ops (log-softmax's `log(sum(exp(x)))`); -1 if it does not come from one."""
    r = g.producer[u]
    while r >= 0 and len(g.ops[r].inputs) == 1 and (g.ops[r].primitive in GPU_ROW_PASS
                                                    or g.ops[r].primitive in ELEMENTWISE):
        r = g.producer[g.ops[r].inputs[0]]
    return r if r >= 0 and g.ops[r].primitive in REDUCTIONS else -1


def _read_outside_rows(g: Program, v: int) -> bool:
    """Whether the shifted rows `v`, or a unary elementwise function of them (`exp(v)`), is
    read by an op outside the softmax's own row computations: a reduction of them, and an
    elementwise op combining them with a row value reduced from them (log-softmax's
    `v - log(sum(exp(v)))`) are inside; anything else (the backward's `exp(v) * row`, with
    the row reduced from the incoming gradient) is outside.

    Where nothing outside reads it, XLA's softmax rewriter takes the whole chain into one
    Triton fusion and `v` is never stored (a forward-only log-softmax over bfloat16 logits:
    one `triton_softmax` fusion writing the float32 log-probabilities)."""
    cone, todo = {v}, [v]
    while todo:
        w = todo.pop()
        for c in g.users[w]:
            op = g.ops[c]
            out = op.outputs[0] if len(op.outputs) == 1 else None
            if out is not None and op.primitive in ELEMENTWISE and len(op.inputs) == 1 and out not in cone:
                cone.add(out)
                todo.append(out)
    for w in cone:
        for c in g.users[w]:
            op = g.ops[c]
            if op.primitive in REDUCTIONS:
                continue
            if op.primitive in ELEMENTWISE and len(op.inputs) == 1 and op.outputs and op.outputs[0] in cone:
                continue
            rows = [u for u in op.inputs if u not in cone]
            if op.primitive in ELEMENTWISE and rows and all(
                    _row_reduction(g, u) >= 0 and g.ops[_row_reduction(g, u)].inputs[0] in cone for u in rows):
                continue
            return True
    return False


def _last_dimension_only(shape: Any, axes: Any) -> bool:
    """Whether a reduce over `axes` of `shape` is one the softmax rewriter takes into a diamond
    (softmax_rewriter_triton.cc, ShouldFuseReduction: exactly one reduced dimension, the
    operand's last). Other reduced dimensions of size one do not count: the algebraic
    simplifier drops them first. A group norm's reduce over height, width and the channels of
    a group is none."""
    rank = len(shape)
    return rank > 0 and rank - 1 in tuple(axes) and all(shape[d] == 1 for d in axes if d != rank - 1)


def softmax_outputs(g: Program, internal: bool = False, triton_only: bool = False) -> Any:
    """Values XLA:GPU stores as the output of a softmax-like fusion (softmax_rewriter_triton.cc:
    a reduction over the minor dimension broadcast back into elementwise ops on the same rows,
    a normalisation as in softmax, log-softmax and layer norm). The diamond's ops form one
    Triton fusion; its result is stored unless every reader is another such op or a reduction.

    A row value combined from two different reductions (softmax's gradient:
    `-sum(g) / sum(exp(x))` times `exp(x)`, added to `g`) is no such diamond: the rewriter
    wants the broadcast value reduced from one tensor through unary ops only, so XLA emits the
    reductions as their own fusions and the combination as a plain loop fusion
    (transformer_train's cross-entropy backward: `loop_add_fusion.1` after two
    `input_reduce_fusion`s), which may write its result into a dying operand's buffer.

    **Returns:** the value ids stored; with `internal`, also those computed only inside the
    fusion (`(stored, inside)`); with `triton_only`, the stored ones whose row values each come
    from one reduction (the Triton fusions, never written in place).
    """
    nv = g.num_values
    reduced = [False] * nv      # a (small) value computed from a row reduction
    diamond = [False] * nv
    sources: list[frozenset] = [frozenset()] * nv   # the reductions a row value comes from
    mixed = [False] * nv        # a diamond whose row value combines several reductions
    roots: list[frozenset] = [frozenset()] * nv     # the full tensors a diamond chain starts from

    def origin(u: int) -> frozenset:
        return roots[u] if (diamond[u] or reduced[u]) else frozenset({u})
    for op in g.ops:
        if len(op.outputs) != 1 or op.outputs[0] is None:
            continue
        v = op.outputs[0]
        prim = op.primitive
        if prim in REDUCTIONS and op.inputs:
            reduced[v] = _last_dimension_only(g.shapes[op.inputs[0]], op.params.get("axes") or ())
            # reducing a row value again (over a unit dimension) keeps its sources
            sources[v] = sources[op.inputs[0]] if reduced[op.inputs[0]] else frozenset({op.index})
            roots[v] = origin(op.inputs[0])
        elif prim in ELEMENTWISE or (prim in GPU_BITCASTS or prim == "broadcast_in_dim"):
            ins = [u for u in op.inputs]
            if prim == "broadcast_in_dim":
                reduced[v] = any(reduced[u] for u in ins)
                sources[v] = frozenset().union(*(sources[u] for u in ins))
                roots[v] = frozenset().union(*(roots[u] for u in ins))
                continue
            if prim in ELEMENTWISE and len(g.shapes[v]) > 0:
                full = [u for u in ins if g.shapes[u] == g.shapes[v]]
                bc = [u for u in ins if reduced[u] and len(g.shapes[u]) == len(g.shapes[v])]
                if bc and any(u not in bc for u in full):
                    roots[v] = frozenset().union(*(origin(u) for u in ins))
                    diamond[v] = True
                    mixed[v] = (len(frozenset().union(*(sources[u] for u in bc))) > 1
                                or any(mixed[u] for u in full if diamond[u]))
                    continue
                if full and any(diamond[u] for u in full) and not reduced[v]:
                    roots[v] = frozenset().union(*(origin(u) for u in ins))
                    diamond[v] = True
                    mixed[v] = any(mixed[u] for u in full if diamond[u])
                    continue
            if all(reduced[u] for u in ins) and ins:
                reduced[v] = True
                sources[v] = frozenset().union(*(sources[u] for u in ins))
                roots[v] = frozenset().union(*(roots[u] for u in ins))
    out, inside = [], []
    for v in range(nv):
        if not diamond[v] or g.producer[v] < 0:
            continue
        for c in g.users[v]:
            cop = g.ops[c]
            if cop.primitive in REDUCTIONS:
                continue
            if any(w is not None and diamond[w] for w in cop.outputs):
                continue
            out.append(v)
            break
        else:
            inside.append(v)
    if triton_only:
        # A mixed row combination is a loop fusion when the Triton fusion of its chain was
        # already cut by a stored diamond (log-softmax's result read by the loss's gather);
        # otherwise the rewriter takes the whole chain into one Triton fusion (the dump of
        # `tests/gpu/fusion_programs.py:cross_entropy_gradient_in_place` against a gradient alone).
        # XLA shares a buffer only between values of one shape and type
        partners = {v: [w for w in out if w != v and roots[w] & roots[v] and g.shapes[w] == g.shapes[v]
                        and g.dtypes[w] == g.dtypes[v]] for v in out if mixed[v]}
        loops = {v: ws for v, ws in partners.items() if any(w != v and roots[w] & roots[v] for w in out)}
        out = [v for v in out if v not in loops]
        return (out, loops) if internal else out
    return (out, inside) if internal else out
