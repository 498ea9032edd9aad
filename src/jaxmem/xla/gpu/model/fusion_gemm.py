"""The GEMM rules of the XLA:GPU model's fusion pass: what XLA:GPU's GEMM fusion
(xla/service/gpu/transforms/gemm_fusion.cc, "triton-gemm-rewriter") writes from a GEMM (its
elementwise epilogue) and which select masks it leaves stored beside it.

`output_epilogues` and `shared_masks_stored` are registered in `fusion.FUSION_RULES`;
`gemm_output_epilogues` is also jaxmem's own GPU plan's second fusion base.
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxmem.compiler.program import Program
from jaxmem.compiler.rules import GPU_BITCASTS
from jaxmem.compiler.stages import Roles
from jaxmem.xla.gpu.model.ops import (DOT_MERGE_BYTES, DOTS, ELEMENTWISE, IO_TOLERANCE_BYTES, FusionContext,
                                      dot_kind, elements, merged_dots)
from jaxmem.xla.gpu.model.splitk import dot_split


def output_epilogues(ctx: FusionContext, fused: list[bool]) -> dict[int, bool]:
    """With `output_epilogues` (the prediction): each GEMM's elementwise epilogue chain is
    written by the GEMM (gemm_fusion.cc: FuseTowardUsers; `gemm_output_epilogues`)."""
    if not ctx.output_epilogues:
        return {}
    new = gemm_output_epilogues(ctx.g, ctx.roles, fused, ctx.device)
    return {v: f for v, f in enumerate(new) if f != fused[v]}


def shared_masks_stored(ctx: FusionContext, fused: list[bool]) -> dict[int, bool]:
    """A select over two full tensors (a relu's backward mask, `where(h > 0, g, 0)`) read by
    several consumers, one of them a GEMM, is stored (with `store_shared_casts`, as XLA does).

    Inside a GEMM's operand fusion such a select reads two tensors to write one, and XLA's GEMM
    fusion takes a producer that reads more than it writes only when the GEMM is its single
    reader (IsInputWorthFusing in xla/service/gpu/transforms/gemm_fusion.cc); with the bias
    gradient's reduction and the input and weight gradients' GEMMs all reading it, the mask is a loop fusion of its own, stored (written in
    place of the incoming gradient: mlp_train's dump, `loop_select_fusion` per layer;
    `tests/gpu/fusion_programs.py:relu_mask_read_by_gemms`). Computed inside each reader, it
    would keep both of its inputs live until the last of them.
    """
    if not ctx.store_shared_casts:
        return {}
    g = ctx.g
    changes = {}
    for op in g.ops:
        if op.primitive != "select_n" or len(op.outputs) != 1 or op.outputs[0] is None:
            continue
        v = op.outputs[0]
        if not fused[v] or len(g.users[v]) < 2:
            continue
        full = {u for u in op.inputs if g.shapes[u] == g.shapes[v] and g.nbytes[u] > IO_TOLERANCE_BYTES}
        if len(full) >= 2 and any(g.ops[c].primitive in DOTS for c in g.users[v]):
            changes[v] = False
    return changes


def gemm_output_epilogues(g: Program, roles: Roles, fused: Sequence[bool], device: str | None) -> list[bool]:
    """`fused` with each GEMM's elementwise epilogue computed inside the GEMM, as XLA:GPU's GEMM
    fusion (backends/gpu/transforms/gemm_fusion.cc, `FuseTowardUsers`, run as
    "triton-gemm-rewriter") builds it: from the dot, while the value has exactly one user and
    that user is an elementwise op of the same shape, the user joins the GEMM fusion (its other
    operands become the fusion's parameters); the last value of that chain is what the GEMM
    writes. So the dot's result and the chain's inner values are never stored, and the chain's
    last value is stored even where the model had computed it inside its own consumer (a GEMM
    fusion is no producer priority fusion fuses).

    In jax 0.10.2's plugin the chain takes any elementwise op (subtract, add, tanh, maximum,
    divide, convert, select), not only the ops distributive over addition the public source
    lists (measured deviceless on H100: `w - 0.1 * (x.T @ d)`, `tanh(x.T @ d)`, `w - tanh(...)`
    are each one `__triton_gemm` fusion). The user's other operands must be arguments, or
    broadcasts of scalars or arguments (`_epilogue_operands_ok`: `x.T @ d + w.T` is not taken),
    and it must not write more bytes than it reads (`_epilogue_not_growing`: a widening convert
    is not taken unless it is an output). It stops at a value with two users (the gradient also
    returned, or `0.1 * g` read by two Adam moments), at a reduction and at a transpose (one
    right after the dot is folded into the dot: `w - 0.1 * (d.T @ x).T`). GEMMs
    the split-K rewriter splits (it runs first: the dot's one user is then the reduce) and
    dots the dot merger joins (their result has several slices as users) keep their result.
    `device` None (jaxmem's own plan, `gpu_plan_fusion`): no GEMM is split, every chain is taken.
    """
    out = list(fused)
    merged = {oi for grp in merged_dots(g, range(len(g.ops))) for oi in grp} | _sharing_dots(g)
    for op in g.ops:
        if op.primitive != "dot_general" or len(op.outputs) != 1 or op.outputs[0] is None:
            continue
        v = op.outputs[0]
        if out[v] or op.index in merged or dot_kind(op, g) != "gemm" or (device and dot_split(g, op, device) > 1):
            continue
        chain = []
        while len(g.users[v]) == 1 and not (roles.outputs[v] or roles.external[v]):
            user = g.ops[g.users[v][0]]
            if not chain and user.primitive == "transpose" and len(user.outputs) == 1 and user.outputs[0] is not None:
                # the algebraic simplifier folds a transpose of a dot's result into the dot
                chain.append(v)
                v = user.outputs[0]
                continue
            if (user.primitive not in ELEMENTWISE or len(user.outputs) != 1 or user.outputs[0] is None
                    or user.operands.count(v) != 1 or g.shapes[user.outputs[0]] != g.shapes[v]
                    or not _epilogue_operands_ok(g, user, v)
                    or not (_epilogue_not_growing(g, user) or roles.outputs[user.outputs[0]])):
                break
            chain.append(v)
            v = user.outputs[0]
        if not chain or g.ops[g.producer[v]].primitive == "transpose":
            continue
        for u in chain:
            out[u] = True
        out[v] = False
    return out


def _sharing_dots(g: Program) -> set[int]:
    """GEMMs that share an operand (same side, same dimension numbers) with another small
    enough GEMM: XLA's dot merger may join them even where their other operands differ in a
    free dimension (lstm_fori's backward loop: `x_t.T @ dz` and `h.T @ dz` are one
    `gemm_fusion_dot.5`, f32[384,1024], with no epilogue), which `merged_dots` does not group;
    their results are then not taken by an epilogue."""
    seen: dict[tuple, list[int]] = {}
    for op in g.ops:
        if op.primitive != "dot_general" or len(op.operands) != 2 or op.outputs[0] is None:
            continue
        a, b = op.operands
        if not (isinstance(a, int) and isinstance(b, int)):
            continue
        if g.nbytes[a] + g.nbytes[b] + g.nbytes[op.outputs[0]] > DOT_MERGE_BYTES:
            continue
        dims = repr(op.params["dimension_numbers"])
        seen.setdefault((0, a, dims), []).append(op.index)
        seen.setdefault((1, b, dims), []).append(op.index)
    return {oi for members in seen.values() if len(members) > 1 for oi in members}


def _effective_argument(g: Program, u: int) -> bool:
    """An argument or a bitcast of one (hlo_query::IsEffectiveParameter: reshapes of arguments)."""
    while g.producer[u] >= 0:
        op = g.ops[g.producer[u]]
        if op.primitive not in GPU_BITCASTS or not op.inputs:
            return False
        u = op.inputs[0]
    return True


def _epilogue_operands_ok(g: Program, user: Any, v: int) -> bool:
    """The epilogue user's other operands are what GEMM fusion takes beside the chain
    (triton_tiling_propagation.cc, GetPropagatedDimOrdersAndRequirementsIfProfitablyFusible,
    input to output: "Has multiple inputs - not properly analyzed yet" otherwise): arguments
    (or bitcasts of them), broadcasts of scalars or of arguments, literals."""
    for u in user.operands:
        if u == v or not isinstance(u, int):
            continue
        if _effective_argument(g, u):
            continue
        op = g.ops[g.producer[u]]
        if op.primitive == "broadcast_in_dim" and (not op.inputs or not g.shapes[op.inputs[0]]
                                                   or _effective_argument(g, op.inputs[0])):
            continue
        return False
    return True


def _epilogue_not_growing(g: Program, user: Any) -> bool:
    """IsOutputWorthFusing: the user reads at least as many bytes as it writes, less 1 KiB
    (a widening convert, bf16 -> f32, is not taken unless it is the program's result)."""
    w = user.outputs[0]
    elems = elements(g.shapes[w])
    written = g.nbytes[w]
    read = 0
    for u in user.operands:
        if isinstance(u, int):
            read += g.nbytes[u] * elems // max(1, elements(g.shapes[u]))
        else:
            read += written   # a literal: a broadcast constant of the result's type
    return read - written >= -IO_TOLERANCE_BYTES
