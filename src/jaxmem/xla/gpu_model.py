"""A model of XLA:GPU's memory: its fusion decisions, its buffer assignment, its total.

XLA:GPU fuses far more than XLA:CPU: elementwise chains become loop fusions; broadcasts,
gathers, dynamic slices, slices, transposes and reshapes are computed inside their consumers
(loop, reduction and GEMM fusions: a Triton GEMM reads `w1[idx]` through its operand fusion, so
the gathered weights are never stored); reductions and dots are fusion roots whose results are
stored; cuBLAS GEMMs take a workspace. Buffer assignment then gives arguments and outputs their
own allocations and packs every temporary into one block, placed by a heap simulation over the
memory scheduler's order (the best of list, DFS and post order). GEMMs that share an operand
are one GEMM whose result lives until its last slice is read (XLA's dot merger).

This module states those rules on jaxmem's own program representation (`compiler.program`,
through the one front end `compiler.jaxpr_adapter`) and reuses the planner's schedulers and
liveness, so no second front end or liveness model appears:

    >>> import jax, jax.numpy as jnp
    >>> def f(w, idx):   # gathered rows, scaled, exponentiated, summed: one reduction fusion on XLA:GPU
    ...     return jnp.exp(w[idx] * 2.0).sum(axis=1)
    >>> pred = predict(jax.make_jaxpr(f)(jnp.ones((8, 1024)), jnp.arange(256) % 8), device="h100-80gb")
    >>> pred.total_bytes, pred.temp_bytes   # argument + output + temp - alias; w[idx] never stored
    (34816, 0)

`gpu_fusion` is also the planner's fusion base on GPU targets (`plan_jaxpr(base_fusion=...)`).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Sequence

from jaxmem.accelerators import ACCELERATORS
from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.fusion import fusion_of, forced_fusion
from jaxmem.compiler.liveness import assign_buffers
from jaxmem.compiler.plan_types import Const
from jaxmem.compiler.program import DROPPED, Program
from jaxmem.compiler.rules import RULES, UNKNOWN, MAX_FUSED_READERS, storage_rule
from jaxmem.compiler.stages import Analysis, Roles, align, live_profile
from jaxmem.xla.gpu_cost import (NOT_DUPLICATED, Kernel, bf16_arithmetic_native, device_numbers,
                                 duplicate_is_faster, flops_per_element)
from jaxmem.xla.gpu_splitk import with_splitk_partials

# -- the fusion rules ----------------------------------------------------------------------------

ELEMENTWISE = frozenset(n for n, r in RULES.items() if r.cost == "elementwise") | {"convert_element_type"}
# Data movement XLA:GPU computes inside its consumer (gpu_fusible.cc: IsFusible; the producer
# side of instruction_fusion.cc / priority_fusion.cc).
MOVEMENT = frozenset({"broadcast_in_dim", "iota", "reshape", "squeeze", "expand_dims", "transpose",
                      "gather", "dynamic_slice", "slice", "pad", "concatenate", "rev",
                      # newer JAX's own primitives, lowered to the ops above (rules.py): `tile` a
                      # broadcast and reshape, `stack` a concatenate of reshapes, `empty` a
                      # broadcast zero; `split` and `unstack` a slice per output
                      "tile", "stack", "empty", "empty2", "split", "unstack",
                      # computed inside its readers where they allow it (`updates_read_inside`)
                      "dynamic_update_slice"})
# Movement ops with several outputs (one slice each in HLO): each output is fused on its own.
MULTI_OUTPUT_MOVEMENT = frozenset({"split", "unstack"})
# Of those newer primitives, a result a GEMM reads (through layout ops) stays stored: XLA
# computes the slice in a loop fusion with the reshape and transpose after it and stores that
# (the same bytes, from the producer to the GEMM), and the GEMM reads the copy: a split of a
# fused qkv projection into heads (`loop_transpose_fusion`, op_name split, f32[4,8,512,64]
# each); fusing the slices into the GEMMs instead held the whole projection to the last of
# them (transformer_train 1.005 -> 1.022 on H100).
GEMM_BOUND_STORED = frozenset({"tile", "stack", "split", "unstack", "empty", "empty2"})
FUSIBLE_PRODUCERS = ELEMENTWISE | MOVEMENT
# Transcendentals (HloInstruction::IsExpensive): a chain holding one is not duplicated into
# several consumers nor into a GEMM prologue; it is stored (mlp_deep_train's silu outputs).
EXPENSIVE = frozenset({"exp", "exp2", "expm1", "log", "log1p", "logistic", "tanh", "erf", "erfc", "erf_inv",
                       "pow", "sin", "cos", "tan", "atan2", "asin", "acos", "atan", "sinh", "cosh", "asinh",
                       "acosh", "atanh", "lgamma", "digamma", "igamma", "igammac", "bessel_i0e", "bessel_i1e",
                       "cbrt", "polygamma", "zeta", "random_gamma_grad", "regularized_incomplete_beta"})
DOTS = frozenset({"dot_general", "conv_general_dilated"})
# Consumers that are loop, input (reduction) or scatter/in-place fusions: they absorb any
# fusible producer.
LOOP_CONSUMERS = (ELEMENTWISE | MOVEMENT | {"dynamic_update_slice", "select_and_scatter_add"}
                  | frozenset(n for n, r in RULES.items() if r.cost == "reduction"))
# GEMMs: Triton GEMM fusions (gemm_fusion.cc) read their operands through bitcasts,
# transposes, broadcasts, converts, slices, gathered rows and elementwise ops (a relu before a
# dot is recomputed in the GEMM's prologue, seen in mlp_train's dump).
DOT_OPERAND_PRODUCERS = frozenset({"reshape", "squeeze", "expand_dims", "transpose", "broadcast_in_dim",
                                   "convert_element_type", "gather", "dynamic_slice", "slice", "iota"})
# cuBLAS's workspace (gemm_rewriter.cc: kHopperWorkspace / kDefaultWorkspace), a temporary
# beside each GEMM. Per compute capability major version.
CUBLAS_WORKSPACE = {9: 0, 8: 0, 7: 0}
DEVICE_SM = {a.name: a.compute_capability for a in ACCELERATORS.values() if a.compute_capability}


def _absorbs(producer: str, consumer: str, operand_index: int, update_read_inside: bool = False) -> bool:
    if consumer in ("dot_general", "conv_general_dilated"):
        if consumer == "conv_general_dilated":
            return producer in ("reshape", "squeeze", "expand_dims", "transpose")
        return producer in DOT_OPERAND_PRODUCERS or producer in ELEMENTWISE
    if consumer == "dynamic_update_slice" and operand_index == 0:
        # updated in place (the buffer itself is the operand), unless the update is itself
        # computed inside its readers (`updates_read_inside`)
        return update_read_inside
    if consumer in ("scatter", "scatter-add", "scatter_add") and operand_index == 0:
        return False
    return consumer in LOOP_CONSUMERS or consumer.startswith("scatter")


def updates_read_inside(g: Program, roles: Roles) -> set[int]:
    """The dynamic_update_slice ops XLA:GPU computes inside each of their readers instead of
    storing: every reader is a loop, reduction or concatenate kernel that reads it whole (a
    KV-cache decode's `dynamic_update_slice(cache[l], k_new)` read by the attention's
    strength-reduced dot and by the `jnp.stack` of the new cache: XLA's dump has the update
    inside both fusions and stores neither). An update that is an output, read as the buffer of
    another update or scatter, or by a GEMM, is stored and updated in place as before. `g` as
    `strength_reduced` leaves it (a matrix-vector dot is the reduction that reads the update)."""
    found = set()
    for op in g.ops:
        if op.primitive != "dynamic_update_slice" or len(op.outputs) != 1 or op.outputs[0] is None:
            continue
        v = op.outputs[0]
        if roles.outputs[v] or roles.external[v] or not g.users[v] or len(g.users[v]) > MAX_FUSED_READERS:
            continue
        if all(_absorbs("dynamic_update_slice", g.ops[c].primitive, k)
               for c in g.users[v] for k, u in enumerate(g.ops[c].operands) if u == v):
            found.add(op.index)
    return found


def strength_reduced(g: Program) -> Program:
    """The program as XLA:GPU's algebraic simplifier leaves its dots: a dot_general with no
    contracting dimension (an outer product) is a multiply of broadcasts, one where a side has
    no free dimension (a batched matrix-vector product) a multiply and a reduction
    (algebraic_simplifier.cc, dot strength reduction). Both then fuse like any elementwise op or
    reduction: MoE's `einsum("td,tdf->tf", x, w1[idx])` reads the gathered weights inside a
    reduction and never stores them. Other ops are kept; the program is not copied otherwise."""
    ops = list(g.ops)
    changed = False
    for op in g.ops:
        if op.primitive != "dot_general" or len(op.inputs) < 1:
            continue
        kind = dot_kind(op, g)
        if kind != "gemm":
            ops[op.index] = replace(op, primitive="mul" if kind == "outer" else "reduce_sum")
            changed = True
    return replace(g, ops=ops) if changed else g


def dot_kind(op: Any, g: Program) -> str:
    """'gemm' (a cuBLAS/Triton GEMM), 'outer' (no contraction) or 'matvec' (a side with no free
    dimension)."""
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    operands = [u for u in op.operands]
    if len(operands) < 2:
        return "gemm"
    shapes = []
    for u in operands[:2]:
        shapes.append(g.shapes[u] if isinstance(u, int) else tuple(getattr(getattr(u, "aval", None), "shape", ())))
    if not lc:
        return "outer"
    lfree = len(shapes[0]) - len(lc) - len(lb)
    rfree = len(shapes[1]) - len(rc) - len(rb)
    if lfree == 0 or rfree == 0:
        return "matvec"
    return "gemm"


def gpu_fusion(g: Program, roles: Roles, forced: Sequence[bool] | None = None,
               store_shared_casts: bool = False, device: str | None = None,
               reread_rule: bool = False) -> list[bool]:
    """Per value, True when XLA:GPU never stores it: computed inside each of its consumers.

    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.compiler.stages import Roles
    >>> program = ja.inline(jax.make_jaxpr(lambda w, i: jnp.tanh(w[i] * 2.0).sum(axis=1))(
    ...     jnp.ones((8, 1024)), jnp.arange(256) % 8))
    >>> n = program.num_values
    >>> roles = Roles([v in program.invars for v in range(n)], [v in program.outvars for v in range(n)],
    ...               [False] * n, {})
    >>> fused = gpu_fusion(program, roles, forced_fusion(program, roles))
    >>> [(op.primitive, fused[op.outputs[0]]) for op in program.ops][-4:]
    [('gather', True), ('mul', True), ('tanh', True), ('reduce_sum', False)]

    **Arguments:** the program, the values' roles, the fusion already forced (views of
    arguments; `fusion.forced_fusion`); `store_shared_casts`: store a narrowing cast read by a GEMM and another reader, as XLA does
    (`_narrowing_shared`); the prediction sets it, jaxmem's own plan (the planner's fusion base)
    computes the cast in each reader, which is valid and holds less. `device`: a GPU preset
    whose performance model decides whether a transcendental chain read by several loop
    kernels is computed in each (`_duplicated`), and whose GEMM fusion sees whole chains
    (a value computed from a transcendental through elementwise ops is never a GEMM's
    prologue, stored or not); None (jaxmem's own plan) stores every such chain, which is
    valid. `reread_rule` (with a `device`): store cheap values that a reader re-reads many
    times, as XLA does (`_reread_stored`); off in `predict` until the memory scheduler is
    modelled to match (see `_reread_stored`).

    **Returns:** per value, the fused flag (outputs and loop-body results are never fused).
    """
    fused = list(forced) if forced is not None else forced_fusion(g, roles)
    g = strength_reduced(g)
    dev = device_numbers(device) if device else None
    costly = [False] * g.num_values   # a fused chain with a transcendental op in it
    tainted = _tainted(g) if dev else costly
    # cheap values whose readers read each element many times, priced as stored (`_reread_stored`)
    reread = _reread_stored(g, roles, fused, tainted, dev) if dev and reread_rule else set()
    updates_inside = updates_read_inside(g, roles)
    for op in g.ops:
        if op.primitive in EXPENSIVE or any(fused[u] and costly[u] for u in op.inputs):
            for w in op.outputs:
                if w is not None:
                    costly[w] = True
        if op.primitive not in FUSIBLE_PRODUCERS or op.effectful:
            continue
        if len(op.outputs) != 1 and op.primitive not in MULTI_OUTPUT_MOVEMENT:
            continue
        for v in op.outputs:
            if v is None or fused[v] or roles.outputs[v] or roles.external[v] or not g.users[v]:
                continue
            if len(g.users[v]) > MAX_FUSED_READERS or v in reread:
                continue
            if op.primitive in GEMM_BOUND_STORED and read_by_gemm(g, v, through=VIEW_OPS):
                continue
            ok = True
            for c in g.users[v]:
                cop = g.ops[c]
                for k, u in enumerate(cop.operands):
                    if u == v and not _absorbs(op.primitive, cop.primitive, k, c in updates_inside):
                        ok = False
                        break
                if not ok:
                    break
            into_gemm = any(g.ops[c].primitive in DOTS for c in g.users[v])
            if ok and (costly[v] or tainted[v]) and into_gemm:
                ok = False  # not into a GEMM's prologue
            elif (ok and GEMM_PROLOGUE_INPUT_WORTH and dev is not None and (into_gemm or read_by_gemm(g, v))
                  and not _input_worth_fusing(g, op)):
                # GEMM fusion stops there and the GEMM reads it stored. XLA's choice, not a need:
                # jaxmem's own plan (no device) keeps it in the GEMM's operand (mlp_deep_train's
                # plan 115.3 MiB with the rule, 99.4 without)
                ok = False
            elif ok and costly[v] and len(g.users[v]) > 1:
                # not duplicated into several consumers, unless the device's cost model says so
                ok = dev is not None and _duplicated(g, roles, fused, tainted, dev, v, reread)
            if ok and store_shared_casts and _narrowing_shared(g, op, v):
                ok = False
            if ok:
                fused[v] = True
    if store_shared_casts:
        store_shared_masks(g, fused)
    stored, inside = softmax_outputs(g, internal=True)
    for v in stored:
        if not roles.external[v]:
            fused[v] = False
    for v in inside:
        if not (roles.outputs[v] or roles.external[v]):
            fused[v] = True
    if device is not None:
        for v in widened_softmax_roots(g):
            if not roles.external[v]:
                fused[v] = False
    return fused


# Layout ops XLA folds into a GEMM's dimension numbers (the algebraic simplifier folds a
# transpose into the dot), so what they read is the GEMM's operand itself. Transposes only:
# taking reshapes too stored attention_train's qkv gradient (`add_any` of three pads, read by
# the weight-gradient GEMM through a reshape), and A100's prediction rose 1.031 -> 1.040.
GEMM_LAYOUT_OPS = frozenset({"transpose"})
# Reshapes and transposes: what a GEMM reads a new movement primitive's result through
# (`GEMM_BOUND_STORED`: the qkv split's heads are reshaped, then transposed).
VIEW_OPS = frozenset({"transpose", "reshape", "squeeze", "expand_dims"})


def read_by_gemm(g: Program, v: int, depth: int = 4, through: frozenset = GEMM_LAYOUT_OPS) -> bool:
    """Whether a GEMM reads `v`, directly or through up to `depth` layout ops
    (`GEMM_LAYOUT_OPS`): `(a - b).T @ x` reads the subtract as its operand
    (`benchmarks/outside_models/while_data.py`'s dump: `loop_subtract_fusion` f32[512,512] is
    stored and the GEMM reads it through a bitcast, its transpose folded into the dot). Used
    by the input-worth rule; a transcendental chain before a transpose stays fused into the
    transposed copy, which is stored (the same bytes as XLA's stored chain)."""
    for c in g.users[v]:
        op = g.ops[c]
        if op.primitive in DOTS:
            return True
        if depth > 0 and op.primitive in through and len(op.outputs) == 1 and op.outputs[0] is not None:
            if read_by_gemm(g, op.outputs[0], depth - 1, through):
                return True
    return False


# On: with all four of these rules on, of the 21 suite programs x 2 devices only rnn_scan_grad's
# prediction moves (1.013 -> 0.985), and the programs outside the suite that show them come to
# XLA's figure (BENCHMARKS.md, issue 17). See `_input_worth_fusing`.
GEMM_PROLOGUE_INPUT_WORTH = True


def _input_worth_fusing(g: Program, op: Any) -> bool:
    """Whether XLA:GPU's GEMM fusion takes elementwise `op` into a GEMM's operand
    (triton_tiling_propagation.cc, output to input: IsInputWorthFusing and the exception before
    it): a binary op with a broadcast argument or constant operand; else one that reads at most
    1 KiB more than it writes (in HLO every operand is full-shape: a scalar literal is a
    broadcast constant); else, with one user, one whose operands are all arguments or constants
    read only by it. A select on a dropout or relu mask reads a mask and two values and is
    stored (`loop_select_fusion` in the dumps of `drop_small.py:nodrop`, `dropout_typedkey`)."""
    if op.primitive not in ELEMENTWISE or len(op.outputs) != 1 or op.outputs[0] is None:
        return True
    w = op.outputs[0]
    elems = _elements(g.shapes[w])

    def broadcast_leaf(u: Any) -> bool:
        if not isinstance(u, int):
            return True
        prod = g.producer[u]
        if prod < 0:
            return False
        b = g.ops[prod]
        return b.primitive == "broadcast_in_dim" and (not b.inputs or g.producer[b.inputs[0]] < 0)

    if len(op.operands) == 2 and any(broadcast_leaf(u) for u in op.operands):
        return True
    read = 0
    for u in op.operands:
        if isinstance(u, int):
            read += g.nbytes[u] * elems // max(1, _elements(g.shapes[u]))
        else:
            read += g.nbytes[w]
    if read - g.nbytes[w] <= IO_TOLERANCE_BYTES:
        return True
    if len(g.users[w]) > 1:
        return False
    return all(not isinstance(u, int) or (g.producer[u] < 0 and len(g.users[u]) == 1) for u in op.operands)


def _float_bytes(dtype: Any) -> int:
    """Bytes per element of a floating dtype; 0 for any other."""
    name = str(dtype)
    if not (name.startswith("float") or name.startswith("bfloat")):
        return 0
    digits = "".join(ch for ch in name if ch.isdigit())
    return int(digits[:2]) // 8 if digits else 0


# Ops between a row reduction and its use that keep it a row value of the same reduction.
_ROW_PASS = frozenset({"broadcast_in_dim", "reshape", "expand_dims", "squeeze", "stop_gradient", "max", "min"})


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
        while r >= 0 and g.ops[r].primitive in _ROW_PASS and len(g.ops[r].inputs) == 1:
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
        if 0 < _float_bytes(g.dtypes[src]) < _float_bytes(g.dtypes[full]) and _read_outside_rows(g, v):
            out.append(v)
    return out


def _row_reduction(g: Program, u: int) -> int:
    """The reduction op a row value `u` comes from, through broadcasts, reshapes and unary
    elementwise ops (log-softmax's `log(sum(exp(x)))`); -1 if it does not come from one."""
    r = g.producer[u]
    while r >= 0 and len(g.ops[r].inputs) == 1 and (g.ops[r].primitive in _ROW_PASS
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


def store_shared_masks(g: Program, fused: list[bool]) -> None:
    """A select over two full tensors (a relu's backward mask, `where(h > 0, g, 0)`) read by
    several consumers, one of them a GEMM, is stored: marked not fused in `fused`.

    Inside a GEMM's operand fusion such a select reads two tensors to write one, and XLA's GEMM
    fusion takes a producer that reads more than it writes only when the GEMM is its single
    reader (IsInputWorthFusing); with the bias gradient's reduction and the input and weight
    gradients' GEMMs all reading it, the mask is a loop fusion of its own, stored (written in
    place of the incoming gradient: mlp_train's dump, `loop_select_fusion` per layer;
    `tests/gpu/fusion_programs.py:relu_mask_read_by_gemms`). Computed inside each reader, it
    would keep both of its inputs live until the last of them.
    """
    for op in g.ops:
        if op.primitive != "select_n" or len(op.outputs) != 1 or op.outputs[0] is None:
            continue
        v = op.outputs[0]
        if not fused[v] or len(g.users[v]) < 2:
            continue
        full = {u for u in op.inputs if g.shapes[u] == g.shapes[v] and g.nbytes[u] > IO_TOLERANCE_BYTES}
        if len(full) >= 2 and any(g.ops[c].primitive in DOTS for c in g.users[v]):
            fused[v] = False


def _tainted(g: Program) -> list[bool]:
    """Per value, whether it is computed from a transcendental op through elementwise ops and
    data movement alone. XLA:GPU's GEMM fusion runs before priority fusion, on the unfused
    program, and takes no such chain into a GEMM's operand (transformer_train's dumps: gelu's
    output is stored on both devices, whether its tanh is stored, on A100, or recomputed, on
    H100; mlp_deep_train's silu outputs likewise)."""
    tainted = [False] * g.num_values
    for op in g.ops:
        hit = op.primitive in EXPENSIVE or (op.primitive in FUSIBLE_PRODUCERS
                                            and any(tainted[u] for u in op.inputs))
        if hit:
            for w in op.outputs:
                if w is not None:
                    tainted[w] = True
    return tainted


def _elements(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# How far the cost model follows a chain (values); past it the chain is stored.
_WALK_LIMIT = 400


def _duplicated(g: Program, roles: Roles, fused: list[bool], tainted: list[bool], dev: Any, v: int,
                reread: set[int] = frozenset()) -> bool:
    """Whether XLA:GPU computes the transcendental chain ending at `v` inside each loop kernel
    that reads it (priority fusion, `gpu_cost.duplicate_is_faster`), rather than storing it.

    The kernels reading `v` are found by following its readers through values that are
    themselves fused (cheap elementwise ops and data movement, computed in each of their
    readers); each kernel's FLOPs and bytes are those of its cone, up to stored values
    (`reread`: values `_reread_stored` stores, each then a kernel of its own).
    """
    start = g.producer[v]

    def inside(w: int) -> bool:
        """Computed inside its readers (for values after `v`, as the rules will decide)."""
        if w == v or w in reread:
            return False
        p = g.producer[w]
        if p < 0 or roles.outputs[w] or roles.external[w]:
            return False
        if p < start:
            return fused[w]
        op = g.ops[p]
        if op.primitive not in FUSIBLE_PRODUCERS or len(op.outputs) != 1 or op.effectful or not g.users[w]:
            return False
        if len(g.users[w]) > MAX_FUSED_READERS:
            return False
        for c in g.users[w]:
            cop = g.ops[c]
            if cop.primitive in DOTS and tainted[w]:
                return False
            if any(u == w and not _absorbs(op.primitive, cop.primitive, k) for k, u in enumerate(cop.operands)):
                return False
        return True

    def cone(root: int, stop: set[int]) -> Kernel | None:
        """The kernel computing op `root`: FLOPs of its fused ops, bytes of the stored values read."""
        rop = g.ops[root]
        flops: dict[int, float] = {}
        reads: dict[int, int] = {}
        seen: set[int] = set()
        todo = [root]
        while todo:
            oi = todo.pop()
            op = g.ops[oi]
            out = next((w for w in op.outputs if w is not None), None)
            size = _elements(g.shapes[out]) if out is not None else 0
            if op.primitive in REDUCTIONS and op.inputs:
                size = _elements(g.shapes[op.inputs[0]])
            if op.primitive in ELEMENTWISE or op.primitive in REDUCTIONS:
                flops[oi] = flops_per_element(dev, op.primitive, str(g.dtypes[out]) if out is not None else "",
                                              op.params) * size
            for u in op.inputs:
                if u in seen:
                    continue
                seen.add(u)
                if len(seen) > _WALK_LIMIT:
                    return None
                if u not in stop and inside(u):
                    todo.append(g.producer[u])
                else:
                    reads[u] = g.nbytes[u]
        written = sum(g.nbytes[w] for w in rop.outputs if w is not None)
        out = next((w for w in rop.outputs if w is not None), v)
        # a reduction's kernel runs over its input: a value broadcast into it is read (and,
        # fused, computed) once per element of that input
        space = rop.inputs[0] if rop.primitive in REDUCTIONS and rop.inputs else out
        return Kernel(flops, _elements(g.shapes[space]), reads, written)

    # The producer: `v`'s own cone, through the values already fused into it.
    pflops: dict[int, float] = {}
    preads: dict[int, int] = {}
    seen, todo = set(), [start]
    while todo:
        oi = todo.pop()
        op = g.ops[oi]
        out = op.outputs[0]
        if op.primitive in NOT_DUPLICATED:
            return False
        if op.primitive in ELEMENTWISE:
            pflops[oi] = flops_per_element(dev, op.primitive, str(g.dtypes[out]), op.params) * _elements(g.shapes[out])
        for u in op.inputs:
            if u in seen:
                continue
            seen.add(u)
            if len(seen) > _WALK_LIMIT:
                return False
            if g.producer[u] >= 0 and fused[u] and not (roles.outputs[u] or roles.external[u]):
                todo.append(g.producer[u])
            else:
                preads[u] = g.nbytes[u]
    producer = Kernel(pflops, _elements(g.shapes[v]), preads, g.nbytes[v])

    # The kernels reading it: the first ops, along each path of fused values, whose result is stored.
    roots: list[int] = []
    seen_v, todo = {v}, [v]
    while todo:
        w = todo.pop()
        for c in g.users[w]:
            cop = g.ops[c]
            out = cop.outputs[0] if len(cop.outputs) == 1 else None
            if out is not None and cop.primitive in FUSIBLE_PRODUCERS and inside(out):
                if out not in seen_v:
                    seen_v.add(out)
                    if len(seen_v) > _WALK_LIMIT:
                        return False
                    todo.append(out)
            elif cop.primitive in LOOP_CONSUMERS or cop.primitive.startswith("scatter"):
                if c not in roots:
                    roots.append(c)
            else:
                return False   # an opaque reader (a loop, a call) needs `v` stored
    if len(roots) <= 1:
        return True
    consumers = []
    for r in roots:
        k = cone(r, {v})
        if k is None:
            return False
        consumers.append(k)
    return duplicate_is_faster(dev, producer, v, consumers)


def _kernel_space(g: Program, op: Any) -> int:
    """Elements a loop, reduction or scatter kernel rooted at `op` runs over: the largest of its
    inputs and outputs (a reduction runs over its input, a scatter over its updates, a
    strength-reduced matvec over the broadcast product of its operands)."""
    sizes = [_elements(g.shapes[u]) for u in op.inputs]
    sizes += [_elements(g.shapes[w]) for w in op.outputs if w is not None]
    return max(sizes, default=1)


def _reread_stored(g: Program, roles: Roles, fused: list[bool], tainted: list[bool], dev: Any) -> set[int]:
    """Cheap elementwise values XLA:GPU stores because a kernel reading them reads each element
    many times (a broadcast into a reduction, an outer product into a scatter's updates).

    Priority fusion prices every producer, cheap or not, with its cost model
    (`gpu_cost.duplicate_is_faster`); fused into a consumer it is computed once per element the
    consumer reads (the operand's utilization: gpu_performance_model.cc multiplies the
    producer's FLOPs by it), and it reads its own inputs that often. Fused into a kernel that
    broadcasts it 128 times, even a multiply costs more than writing and reading it once: in
    moe_train's dumps the gelu output `h`, read by the second einsum's reduction and by the
    weight gradient's scatter, is stored on both devices (`loop_multiply_fusion` on H100, the
    first output of `loop_multiply_tanh_fusion` on A100), and so are the output gradient and
    gelu's input gradient that the scatters broadcast. Where no reader re-reads the value,
    fusion wins and the other rules stand. Small programs put XLA's threshold where the cost
    model does (`tests/gpu/fusion_programs.py`: `x * 2 + 1` broadcast 2 or 8 times is fused, 16
    or more times stored, on H100 and A100).

    The producer's cone is priced with transcendentals stored (the cheapest producer: a chain
    that also recomputes a tanh costs more fused, so it is stored a fortiori); GEMM readers are
    left out (XLA's GEMM fusion, not priority fusion, takes producers into them).

    Not used by `predict` yet (`gpu_fusion(reread_rule=...)`): on moe_train it stores what XLA
    stores, but then XLA's memory scheduler picks its post-order sequence (its VLOG: list
    11.51, DFS 12.04, post order 11.26 MiB) where the model's list and DFS orders hold less,
    so the prediction falls (A100 0.949 -> 0.898, H100 1.000 -> 0.946); in XLA's post order
    the model's heap is XLA's temp to 256 bytes on both devices.
    """
    stored: set[int] = set()

    def fusible(w: int, reader_side: bool) -> bool:
        """Whether `w` is computed inside its readers, as far as this rule can tell."""
        p = g.producer[w]
        if p < 0 or roles.outputs[w] or roles.external[w]:
            return False
        if fused[w]:
            return True
        op = g.ops[p]
        if (op.primitive not in FUSIBLE_PRODUCERS or len(op.outputs) != 1 or op.effectful or not g.users[w]
                or len(g.users[w]) > MAX_FUSED_READERS or w in stored):
            return False
        # a transcendental read twice is priced by `_duplicated`; here it is taken as stored
        if op.primitive in EXPENSIVE and not (reader_side and len(g.users[w]) == 1):
            return False
        for c in g.users[w]:
            cop = g.ops[c]
            if cop.primitive in DOTS and tainted[w]:
                return False
            if any(u == w and not _absorbs(op.primitive, cop.primitive, k) for k, u in enumerate(cop.operands)):
                return False
        return True

    def cone(root: int, stop: int) -> tuple[dict[int, float], dict[int, int]]:
        """FLOPs of the ops computed in the kernel rooted at op `root`, bytes of the stored
        values it reads (`stop` counted as read)."""
        flops: dict[int, float] = {}
        reads: dict[int, int] = {}
        seen, todo = set(), [root]
        while todo and len(seen) <= _WALK_LIMIT:
            op = g.ops[todo.pop()]
            out = next((w for w in op.outputs if w is not None), None)
            if out is not None and (op.primitive in ELEMENTWISE or op.primitive in REDUCTIONS):
                flops[op.index] = flops_per_element(dev, op.primitive, str(g.dtypes[out]),
                                                    op.params) * _kernel_space(g, op)
            for u in op.inputs:
                if u in seen:
                    continue
                seen.add(u)
                if u != stop and fusible(u, False):
                    todo.append(g.producer[u])
                else:
                    reads[u] = g.nbytes[u]
        return flops, reads

    # Readers first: a chain feeding a stored value is then priced against that value's kernel
    # (in moe_train, gelu's backward chain is fused into its last product, which is stored, not
    # into the scatter that broadcasts the product).
    for op in reversed(g.ops):
        if (op.primitive not in ELEMENTWISE or op.primitive in EXPENSIVE or len(op.outputs) != 1
                or op.outputs[0] is None or op.effectful):
            continue
        v = op.outputs[0]
        if fused[v] or roles.outputs[v] or roles.external[v] or not g.users[v]:
            continue
        # the readers' kernels: the first ops, along each path of fused values, whose result is stored
        roots: list[int] = []
        seen, todo, opaque = {v}, [v], False
        while todo and not opaque:
            w = todo.pop()
            for c in g.users[w]:
                cop = g.ops[c]
                out = cop.outputs[0] if len(cop.outputs) == 1 else None
                if out is not None and cop.primitive in FUSIBLE_PRODUCERS and fusible(out, True):
                    if out not in seen:
                        seen.add(out)
                        todo.append(out)
                elif cop.primitive in DOTS:
                    continue
                elif cop.primitive in LOOP_CONSUMERS or cop.primitive.startswith("scatter"):
                    if c not in roots:
                        roots.append(c)
                else:
                    opaque = True   # a loop or a call reads it: stored whatever the cost
                    break
            opaque = opaque or len(seen) > _WALK_LIMIT
        n = _elements(g.shapes[v])
        if opaque or not roots or all(_kernel_space(g, g.ops[r]) <= n for r in roots):
            continue
        pflops, preads = cone(op.index, -1)
        producer = Kernel(pflops, n, preads, g.nbytes[v])
        consumers = []
        for r in roots:
            cflops, creads = cone(r, v)
            written = sum(g.nbytes[w] for w in g.ops[r].outputs if w is not None)
            consumers.append(Kernel(cflops, _kernel_space(g, g.ops[r]), creads, written))
        if not duplicate_is_faster(dev, producer, v, consumers):
            stored.add(v)
    return stored


# gemm_fusion.cc / triton_fusion_analysis.cc: kIoToleranceBytes, how much an operand fused into a
# GEMM may shrink its data without further conditions.
IO_TOLERANCE_BYTES = 1024


def _narrowing_shared(g: Program, op: Any, v: int) -> bool:
    """A narrowing cast (float32 -> bfloat16) read by a GEMM and by something else is stored.

    XLA's GEMM fusion takes an operand's producer only if it is worth it (IsInputWorthFusing):
    one that reads more bytes than it writes (beyond 1 KiB) must have a single user. A weight
    cast to bfloat16 for the forward GEMM and the backward one fails that, so the cast is its
    own fusion and its result is stored (bf16_train's dump: `wrapped_convert` of each weight;
    `tests/gpu/fusion_programs.py:bf16_weight_read_twice`). Read by one GEMM alone it is
    computed inside it (`bf16_convert_into_gemm`).
    """
    if op.primitive != "convert_element_type" or len(g.users[v]) < 2 or not op.inputs:
        return False
    if g.nbytes[op.inputs[0]] - g.nbytes[v] <= IO_TOLERANCE_BYTES:
        return False
    return any(g.ops[c].primitive in DOTS for c in g.users[v])


def _no_inplace(g: Program, values: Sequence[int]) -> Program:
    """The program with the ops making `values` as opaque fusions: a Triton softmax fusion
    reads each row several times, so its output never takes over an operand's buffer."""
    ops = list(g.ops)
    for v in values:
        oi = g.producer[v]
        if oi >= 0:
            ops[oi] = replace(ops[oi], primitive="gpu_row_fusion")
    return replace(g, ops=ops)


REDUCTIONS = frozenset(n for n, r in RULES.items() if r.cost == "reduction")


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
            axes = op.params.get("axes") or ()
            rank = len(g.shapes[op.inputs[0]])
            reduced[v] = rank > 0 and (rank - 1) in tuple(axes)
            # reducing a row value again (over a unit dimension) keeps its sources
            sources[v] = sources[op.inputs[0]] if reduced[op.inputs[0]] else frozenset({op.index})
            roots[v] = origin(op.inputs[0])
        elif prim in ELEMENTWISE or prim in ("reshape", "squeeze", "expand_dims", "broadcast_in_dim"):
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


# On, measured with the other three (see GEMM_PROLOGUE_INPUT_WORTH and `gemm_output_epilogues`).
GEMM_OUTPUT_EPILOGUE = True


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
    from jaxmem.xla.gpu_splitk import dot_split

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
        if op.primitive not in ("reshape", "squeeze", "expand_dims") or not op.inputs:
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
    elems = _elements(g.shapes[w])
    written = g.nbytes[w]
    read = 0
    for u in user.operands:
        if isinstance(u, int):
            read += g.nbytes[u] * elems // max(1, _elements(g.shapes[u]))
        else:
            read += written   # a literal: a broadcast constant of the result's type
    return read - written >= -IO_TOLERANCE_BYTES


def prediction_fusion(g: Program, roles: Roles, forced: Sequence[bool] | None = None, *,
                      device: str) -> list[bool]:
    """The prediction's fusion: `gpu_fusion` as XLA stores values, then (when
    `GEMM_OUTPUT_EPILOGUE` is on) GEMM epilogues (`gemm_output_epilogues`)."""
    fused = gpu_fusion(g, roles, forced, store_shared_casts=True, device=device)
    if GEMM_OUTPUT_EPILOGUE:
        fused = gemm_output_epilogues(strength_reduced(g), roles, fused, device)
    return fused


# -- the prediction ------------------------------------------------------------------------------

@dataclass
class Prediction:
    """XLA:GPU's figures as the model predicts them (the `memory_analysis()` fields)."""

    device: str
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    seconds: float
    scheduler: str = ""
    fused_values: int = 0
    arguments: list = None    # per flat leaf, as `XlaGpuReference.arguments` (the pool's input)
    outputs: list = None      # per flat output, as `XlaGpuReference.outputs`

    @property
    def total_bytes(self) -> int:
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    def summary(self) -> dict[str, Any]:
        """The JSON `predicted_xla` object."""
        return {"device": self.device, "argument_bytes": self.argument_bytes, "output_bytes": self.output_bytes,
                "temp_bytes": self.temp_bytes, "alias_bytes": self.alias_bytes,
                "total_bytes": self.total_bytes, "seconds": round(self.seconds, 3),
                "scheduler": self.scheduler}


def op_scratch(g: Program, op: Any, workspace: int) -> int:
    """Temporaries XLA:GPU adds around one op, live while it runs: a cuBLAS GEMM's workspace;
    a max-pool gradient (select_and_scatter_add), which XLA:GPU expands into a variadic
    reduce_window (the pooled values and four s32 index arrays, each the size of the source)
    and a scatter into a zero broadcast written in the result's own buffer (the dump of
    `tests/gpu/fusion_programs.py:max_pool_gradient`)."""
    if op.primitive == "dot_general" and dot_kind(op, g) == "gemm":
        return workspace
    if op.primitive == "select_and_scatter_add" and len(op.inputs) >= 2:
        source, operand = op.inputs[0], op.inputs[-1]
        elems = 1
        for d in g.shapes[source]:
            elems *= d
        return align(g.nbytes[source]) + 4 * align(4 * elems)
    return 0


# cuBLASLt's workspace beside the float8 fallback's GEMM (its dump: the custom call's second
# result, s8[4194304], on A100).
FLOAT8_FALLBACK_WORKSPACE = 4 * 2 ** 20
FLOAT8_NATIVE_SM = 89   # float8 GEMMs need compute capability 8.9 (Ada) or later


def float8_fallback_scratch(g: Program, op: Any, device: str) -> int:
    """Temporaries of a float8 x float8 GEMM on a GPU without float8 tensor cores (compute
    capability below 8.9; algorithm_util.cc: IsSupportedDotAlgorithmOnGpu wants Ada for
    ALG_DOT_ANY_F8_ANY_F8_F32). Triton GEMM fusion does not take it there: XLA converts both
    operands to float16, stores them (a loop or transpose fusion each, read by nothing else)
    and calls cuBLASLt, whose 4 MiB workspace sits beside the (split-K) result. The dumps of
    `tests/gpu/fusion_programs.py:splitk_fp8_gemm` and `outside_models/int8_fp8.py` on A100:
    `loop_convert_fusion` f16, `input_transpose_fusion` f16, `__cublas$lt$matmul` ->
    (f32[4,256,512], s8[4194304]). 0 for any other op or device."""
    if op.primitive != "dot_general" or len(op.operands) < 2 or not all(isinstance(u, int) for u in op.operands[:2]):
        return 0
    if not all(str(g.dtypes[u]).startswith("float8") for u in op.operands[:2]) or dot_kind(op, g) != "gemm":
        return 0
    dev = device_numbers(device)
    if dev is None or not dev.sm.startswith("sm_") or int(dev.sm[3:] or 0) >= FLOAT8_NATIVE_SM:
        return 0
    return FLOAT8_FALLBACK_WORKSPACE + sum(2 * _elements(g.shapes[u]) for u in op.operands[:2])


def output_aliases(g: Program, donated: Sequence[bool]) -> dict[int, int]:
    """Output position -> flat argument position whose buffer it takes, as JAX pairs donated
    arguments with outputs of the same shape and dtype (in order) when it lowers."""
    free: dict[tuple, list[int]] = {}
    for k, v in enumerate(g.invars):
        if k < len(donated) and donated[k]:
            free.setdefault((g.shapes[v], g.dtypes[v]), []).append(k)
    out: dict[int, int] = {}
    for j, v in enumerate(g.outvars):
        if isinstance(v, Const):
            continue
        slot = free.get((g.shapes[v], g.dtypes[v]))
        if slot:
            out[j] = slot.pop(0)
    return out


def predict(closed_jaxpr: Any, *, donated: Sequence[bool] = (), device: str = "h100-80gb") -> Prediction:
    """Predict XLA:GPU's `memory_analysis()` for a ClosedJaxpr on a GPU preset.

    >>> import jax, jax.numpy as jnp
    >>> def step(w, x):   # one SGD step
    ...     return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> predict(jax.make_jaxpr(step)(jnp.ones((64, 64)), jnp.ones((8, 64))), device="a100-40gb").total_bytes
    36864

    **Arguments:** `closed_jaxpr`; `donated`, one flag per flat input; `device`, a GPU preset.

    **Returns:** a `Prediction` (argument, output, temp, alias bytes; total as XLA's).
    """
    from jaxmem.compiler import planner  # the planner's roles, schedulers and loop scratch

    start = time.perf_counter()
    with planner.gc_paused():
        g = planner.inlined(closed_jaxpr)  # shared with the plans of the same jaxpr
        flags = list(donated) + [False] * max(0, len(g.invars) - len(donated))
        aliases = output_aliases(g, flags)
        workspace = CUBLAS_WORKSPACE.get(DEVICE_SM.get(device, 9), 4 * 2 ** 20)
        temp_bytes, best_name, fused_values = _device_temps(closed_jaxpr, g, aliases, workspace, device)
        argument_bytes = sum(g.nbytes[v] for v in g.invars)
        output_bytes = sum(g.outvar_bytes)
        alias_bytes = sum(g.outvar_bytes[j] for j in aliases)
        shape = lambda v: f"{g.dtypes[v]}{list(g.shapes[v])}"
        arguments = [{"bytes": g.nbytes[v], "donated": bool(flags[k]), "shape": shape(v)}
                     for k, v in enumerate(g.invars)]
        outputs = [{"bytes": g.outvar_bytes[j], "aliases": aliases.get(j),
                    "shape": g.outvar_bytes[j] if isinstance(v, Const) else shape(v)} for j, v in enumerate(g.outvars)]
    return Prediction(device, argument_bytes, output_bytes, temp_bytes, alias_bytes,
                      time.perf_counter() - start, best_name, fused_values, arguments, outputs)


# The temp figures last predicted, by jaxpr identity, output aliases, GEMM workspace and device
# (priority fusion's cost model is the device's: `gpu_cost`), so a jaxpr predicted again for the
# same device is modelled once. The entry holds the jaxpr, so its id is not reused while kept.
PREDICTIONS_KEPT = 4
_device_temps_kept: dict[tuple, tuple[Any, tuple[int, str, int]]] = {}


def _device_temps(closed_jaxpr: Any, g: Program, aliases: dict[int, int], workspace: int,
                  device: str) -> tuple[int, str, int]:
    """(temp bytes, the memory scheduler's order kept, fused values) for `g`, the inlined
    `closed_jaxpr`, with `aliases` (output -> donated argument) and a GEMM `workspace`, on `device`."""
    key = (id(closed_jaxpr), tuple(sorted(aliases.items())), workspace, device)
    hit = _device_temps_kept.get(key)
    if hit is not None and hit[0] is closed_jaxpr:
        return hit[1]
    result = _temps(g, aliases, workspace, device)
    _device_temps_kept[key] = (closed_jaxpr, result)
    while len(_device_temps_kept) > PREDICTIONS_KEPT:
        del _device_temps_kept[next(iter(_device_temps_kept))]
    return result


def _temps(g: Program, aliases: dict[int, int], workspace: int, device: str) -> tuple[int, str, int]:
    """XLA:GPU's fusion, memory scheduler and buffer assignment modelled on `g` (see `predict`)."""
    heap, best_name, fused = _temp_heap(g, aliases, workspace, device)
    return int(_place(heap) or 0), best_name, fused


def _temp_heap(g: Program, aliases: dict[int, int], workspace: int, device: str,
               roles: Roles | None = None) -> tuple[list[tuple[int, int, int]], str, int]:
    """(the heap's spans, the scheduler kept, fused values) of `_temps`; `roles`: a loop body's
    (`_gpu_loop_scratch`), None for the program itself."""
    from jaxmem.compiler import planner

    # XLA holds every argument and output in its own allocation: none of them is in the temp
    # block, so the liveness below treats them all as external.
    if roles is None:
        roles = planner._roles(g, [False] * len(g.invars), (), ())
    fused = prediction_fusion(g, roles, forced_fusion(g, roles), device=device)
    triton, row_loops = softmax_outputs(g, internal=True, triton_only=True)
    g = _no_inplace(strength_reduced(g), triton)
    # Triton split-K: a split GEMM's partial results, stored in its result's place or beside it
    # (the dot merger runs before the split: it groups GEMMs by their unsplit sizes)
    unsplit = g
    g, partials, fused = with_splitk_partials(g, fused, device)
    # after the split, which may store more values (`_stored_readers`): each is sized as stored
    g = stored_in_f32(g, roles, fused, device)
    scratch, pieces = _gpu_loop_scratch(g, workspace, device)
    for oi, extra in partials.items():
        scratch[oi] = scratch.get(oi, 0) + extra
    for op in g.ops:
        extra = op_scratch(g, op, workspace) + float8_fallback_scratch(g, op, device)
        if extra:
            scratch[op.index] = scratch.get(op.index, 0) + extra
    analysis = Analysis(roles, fusion_of(g, fused), scratch)
    # XLA's memory scheduler keeps the best of its own schedulers (list, DFS, post order); the
    # program's (jaxpr) order is not among them, and taking it ran the loss's gather of
    # log-softmax before the cross-entropy gradient where XLA runs it after (the dumps of
    # transformer_wide_train, scanned_checkpoint_train), so the gradient took a buffer XLA's
    # does not (`_row_loops_in_place`).
    orders: dict[str, list[int]] = {}
    for name in ("list", "dfs"):
        orders[name] = planner.SCHEDULERS[name](g, analysis)
    aliased_values = {g.outvars[j] for j in aliases}
    # XLA's memory scheduler keeps the order with the least memory; each order is scored by its
    # heap's lower bound and only the winner is placed (placement is most of the model's time).
    scored = []
    for name, order in orders.items():
        groups = merged_dots(unsplit, order)
        order = _merged_order(order, groups)
        live = assign_buffers(_row_loops_in_place(g, order, fused, row_loops), order, analysis, True)
        aliased = {live.group[v] for v in aliased_values if live.group[v] >= 0}
        heap = (heap_after_reuse(_with_pieces(g, live, _merge_intervals(g, live, groups), pieces, order, aliased),
                                 aliased)
                + shared_zero_spans(g, order)
                + concatenated_operand_spans(g, order, groups) + scan_output_spans(g, order, roles)
                + donated_output_prefix_spans(g, order, live, aliased,
                                              {live.group[g.outvars[j]]: g.invars[k] for j, k in aliases.items()
                                               if live.group[g.outvars[j]] >= 0}))
        bound = int(live_profile(heap, len(order)).max()) if heap else 0
        scored.append((bound, name, heap))
    bound, best_name, heap = min(scored, key=lambda t: t[0])
    return heap, best_name, sum(fused)


def _gpu_loop_scratch(g: Program, workspace: int, device: str) -> tuple[dict[int, int], dict[int, int]]:
    """Per loop/cond op, its body's temporaries as XLA:GPU compiles the body: (the scratch
    bytes besides the largest, the largest). Each body is modelled as a program of its own
    (`_temp_heap`: its fusion, its split GEMMs' partials, its schedule and heap), with the
    roles the planner gives a body (`planner._loop_scratch`: results written into the loop's
    buffers, a new carry in its old one's). XLA's split-K rewriter visits every non-fusion
    computation, while and scan bodies and cond branches included (splitk_rewriter.cc:
    MakeNonfusionComputations), which the planner's own plan of a body does not know
    (`benchmarks/outside_models/while_data.py`: the body's GEMM holds f32[8,64,512] on H100).
    The largest body value is apart because buffer assignment places each value on its own:
    it may take an output allocation free at the time (`_with_pieces`). Opaque ops with
    jaxprs of their own keep the planner's scratch."""
    from jaxmem.compiler import planner
    from jaxmem.compiler.program import side_table

    cache: dict[tuple, tuple[int, int]] = {}

    def body(closed: Any, pairs: tuple[int | None, ...] | None) -> tuple[int, int]:
        key = (id(closed), pairs)
        if key not in cache:
            b = planner.inlined(ja.as_closed(closed))
            outputs = [True] * len(pairs) if pairs is not None else ()
            roles = planner._roles(b, [False] * len(b.invars), outputs, pairs or ())
            heap = _temp_heap(b, {}, workspace, device, roles)[0]
            total = int(_place(heap) or 0)
            largest = min(total, max((size for _, _, size in heap), default=0))
            cache[key] = (total - largest, largest)
        return cache[key]

    scratch: dict[int, int] = {}
    pieces: dict[int, int] = {}
    nested = side_table(g, "nested jaxprs", planner._nested_jaxprs)
    for op in g.ops:
        bodies = ja.loop_bodies(op.eqn) if op.primitive in ja.LOOP_PRIMITIVES else []
        if op.primitive == "cond":
            parts = [body(b, (None,) * len(op.outputs)) for b in bodies]
        elif op.primitive == "scan":
            num_consts, num_carry = ja.scan_counts(op.eqn)
            parts = [body(bodies[0], tuple(num_consts + k if k < num_carry else None for k in range(len(op.outputs))))]
        elif op.primitive == "while":
            _, body_nconsts = ja.while_counts(op.eqn)
            parts = [body(bodies[0], None), body(bodies[1], tuple(body_nconsts + k for k in range(len(op.outputs))))]
        elif op.index in nested:
            scratch[op.index] = max(planner.plan_jaxpr(ja.as_closed(sub), check=False,
                                                       base_fusion=partial(prediction_fusion, device=device)).arena_bytes
                                    for sub in nested[op.index])
            continue
        else:
            continue
        rest, largest = max(parts, key=sum)
        scratch[op.index] = rest
        if largest:
            pieces[op.index] = largest
    return scratch, pieces


def _with_pieces(g: Program, live: Any, intervals: list[Any], pieces: dict[int, int], order: Sequence[int],
                 aliased: set[int]) -> list[Any]:
    """`intervals` and, per loop op in `pieces`, its body's largest value as a scratch buffer
    of its own while the loop runs, so that buffer assignment may give it an output allocation
    free at the time as it does (while_cond's dump: the while body's f32[4,1024,256] partials
    sit in the allocation of the cond's result, written later). A cond branch's value may
    also take the allocation of the cond's own result when that is a program output, large
    enough and not aliased: the branch writes its result last (while_cond's branch partials,
    f32[4,1024,256], there too)."""
    if not pieces:
        return intervals
    from jaxmem.compiler.liveness import Interval

    pos = {oi: p for p, oi in enumerate(order)}
    extra = []
    for oi, size in sorted(pieces.items()):
        op = g.ops[oi]
        if oi not in pos:
            continue
        if op.primitive == "cond":
            # the result's own allocation only where the result is the program's output (live
            # out: created before any smaller temp); one that a later op updates in place is
            # a temp of the branch's body in XLA (cond_switch_topk's weight gradient: 0.899 ->
            # 0.825 when taken)
            results = {v for v in op.outputs if v is not None} & set(v for v in g.outvars if not isinstance(v, Const))
            own = {live.group[v] for v in results if live.group[v] >= 0} - set(aliased)
            if any(iv.id in own and iv.kind == "output" and iv.size >= size for iv in intervals):
                continue
        extra.append(Interval(-10_000_000 - oi, [], pos[oi], pos[oi], align(size), "scratch", oi))
    return list(intervals) + extra


def stored_in_f32(g: Program, roles: Roles, fused: Sequence[bool], device: str) -> Program:
    """The program with the bytes XLA:GPU stores for bfloat16 arithmetic results on a device
    that computes bfloat16 arithmetic in float32 (`gpu_cost.bf16_arithmetic_native`).

    There a bfloat16 elementwise chain runs in float32; a value of it that is stored and read
    only by other elementwise ops or reductions (also run in float32) is stored as computed,
    in float32: twice its bytes. A value read by a GEMM is converted back to bfloat16 (the
    GEMM reads bfloat16). bf16_train on A100: gelu's stored tanh is f32[4,256,1536] (6 MiB),
    on H100 bf16 (3 MiB), each layer; the same in `tests/gpu/fusion_programs.py:gelu_step_bf16`
    (the activation fusion's second output: f32 on A100, bf16 on H100).
    Converts are left as they are (a convert's result is its stated type).
    """
    dev = device_numbers(device) if device else None
    if dev is None or bf16_arithmetic_native(dev):
        return g
    nbytes = None
    for op in g.ops:
        if op.primitive not in ELEMENTWISE or op.primitive == "convert_element_type" or len(op.outputs) != 1:
            continue
        v = op.outputs[0]
        if v is None or fused[v] or roles.outputs[v] or roles.external[v] or str(g.dtypes[v]) != "bfloat16":
            continue
        readers = [g.ops[c].primitive for c in g.users[v]]
        if not readers or any(r == "convert_element_type" or (r not in ELEMENTWISE and r not in REDUCTIONS)
                              for r in readers):
            continue
        if nbytes is None:
            nbytes = list(g.nbytes)
        nbytes[v] = 2 * g.nbytes[v]
    return replace(g, nbytes=nbytes) if nbytes is not None else g


def _row_loops_in_place(g: Program, order: Sequence[int], fused: Sequence[bool],
                        row_loops: dict[int, list[int]]) -> Program:
    """The program with each loop-fused row combination (`softmax_outputs`' mixed diamonds)
    kept out of its operands' buffers unless, in this order, a stored diamond it reads (the
    log-softmax result) dies at it: XLA:GPU writes the cross-entropy gradient over log-softmax's
    result, never over the scatter of the targets it adds to (transformer_train's buffer
    assignment: `loop_add_fusion.1` at `triton_softmax.14`'s offset), and where its scheduler
    runs the loss's gather of log-softmax after the gradient, over nothing
    (transformer_wide_train, scanned_transformer_train, scanned_checkpoint_train)."""
    if not row_loops:
        return g
    pos = {oi: p for p, oi in enumerate(order)}

    def last_read(w: int) -> int:
        """The position of the last op reading `w`, through the fused values it feeds."""
        last, todo, seen = -1, [w], {w}
        while todo:
            u = todo.pop()
            for c in g.users[u]:
                for x in g.ops[c].outputs:
                    if x is not None and fused[x] and x not in seen:
                        seen.add(x)
                        todo.append(x)
                last = max(last, pos.get(c, -1))
        return last

    blocked = []
    for v, partners in row_loops.items():
        at = pos.get(g.producer[v], -1)
        if not any(last_read(w) <= at for w in partners):
            blocked.append(v)
    return _no_inplace(g, blocked) if blocked else g


def _is_zero(u: Any) -> bool:
    """A literal (scalar) zero operand."""
    try:
        return isinstance(u, Const) and getattr(u.value, "shape", ()) == () and float(u.value) == 0.0
    except (TypeError, ValueError):
        return False


def shared_zero_spans(g: Program, order: Sequence[int]) -> list[tuple[int, int, int]]:
    """Buffers XLA:GPU adds when a max-pool gradient's zeros are also a relu's zeros.

    XLA expands a max-pool gradient (select_and_scatter_add) into a scatter that writes, in
    place, into a zero broadcast of the pooled operand's shape. Where the program reads zeros
    of that shape elsewhere (the relu `max(x, 0)` before the pool, the relu gradient's
    `select(x > 0, g, 0)` after it), XLA's CSE makes them one broadcast; the scatter's in-place
    operand then needs a copy of it, and XLA emits both in one multi-output loop fusion with no
    operands, which its scheduler runs first (the dump of
    `tests/gpu/fusion_programs.py:relu_max_pool_gradient`). So both are live from the start of
    the program: the copy until the scatter takes it over, the zeros until their last reader.
    A lone max-pool gradient (no other zeros of its shape) stores neither.

    **Returns:** (start, end, size) spans over positions of `order`.
    """
    pos = {oi: p for p, oi in enumerate(order)}
    spans = []
    for op in g.ops:
        if op.primitive != "select_and_scatter_add" or len(op.inputs) < 2 or op.index not in pos:
            continue
        operand = op.inputs[-1]
        shape, dtype = g.shapes[operand], g.dtypes[operand]
        last, shared = pos[op.index], False
        for other in g.ops:
            if other.index not in pos or not other.outputs or other.outputs[0] is None:
                continue
            out = other.outputs[0]
            if g.shapes[out] != shape:
                continue
            zeros = [u for u in other.operands if _is_zero(u)]
            if other.primitive == "broadcast_in_dim" and zeros and g.dtypes[out] == dtype:
                shared = True
                last = max([last] + [pos[c] for c in g.users[out] if c in pos])
            elif zeros and other.primitive in ("max", "gt", "select_n"):
                shared = True
                last = max(last, pos[other.index])
        if shared:
            size = align(g.nbytes[operand])
            spans.append((0, pos[op.index] - 1, size))   # the copy, the scatter's in-place buffer
            spans.append((0, last, size))                # the shared zeros
    return spans


def scan_output_spans(g: Program, order: Sequence[int], roles: Roles) -> list[tuple[int, int, int]]:
    """A scan's stacked outputs are held from the start of the program.

    JAX lowers a scan to a while loop whose state holds each stacked output, initialised with
    zeros that every step writes one slice of. That zero broadcast has no operands, so XLA's
    scheduler emits it first: the stacked buffer is live from the program's start, not from
    the loop (scanned_checkpoint_train's dump: the backward scan's four stacked weight
    gradients, 24 MiB of `loop_broadcast_fusion`, live at the cross-entropy gradient before
    the backward scan runs; `tests/gpu/fusion_programs.py:scan_after_large_temporary`). The
    spans cover the positions before the scan; the value's own interval covers the rest.
    Outputs of the program live in their own allocations and are left out.

    **Returns:** (start, end, size) spans over positions of `order`.
    """
    spans = []
    for p, oi in enumerate(order):
        op = g.ops[oi]
        if op.primitive != "scan" or p == 0:
            continue
        _, num_carry = ja.scan_counts(op.eqn)
        for y in op.outputs[num_carry:]:
            if y is None or roles.outputs[y] or roles.external[y] or not g.users[y]:
                continue
            spans.append((0, p - 1, align(g.nbytes[y])))
    return spans


def donated_output_prefix_spans(g: Program, order: Sequence[int], live: Any,
                                aliased: set[int], sources: dict[int, int] | None = None) -> list[tuple[int, int, int]]:
    """Temporaries written in place into a buffer whose output aliases a donated argument.

    jaxmem's liveness lets an output's buffer begin as the buffer of an earlier value that the
    output is computed over in place (a scatter's zeros, the scatter into them, then Adam's
    update of that gradient). When the output takes a donated argument's allocation, XLA
    cannot do that: the argument's allocation holds the argument until the output is written
    (buffer assignment puts nothing but the parameter and its aliased output there), so the
    earlier values are temporaries in the heap, live until the op that writes the output
    (moe_train's dump: each expert weight's 1 MiB gradient scatter, `input_scatter_fusion.1`,
    in the temp block up to Adam's `loop_add_subtract_fusion`; the dump of
    `tests/gpu/fusion_programs.py:scatter_into_donated_output`).

    Except (with `DONATED_UPDATE_CHAIN`) where the earlier values are the donated argument
    updated in place, one `dynamic_update_slice` or scatter after another, the argument read by
    nothing after the first update: XLA's alias analysis makes the argument, each update and
    the output one buffer (an in-place op's operand 0 and result must share), so all of it is
    the argument's allocation. Copy insertion first copies before each update (the updated
    cache is still read), and the copies are removed once the schedule runs every read of the
    old value before the next update (`dus_donate.py:chain_read`'s dumps: four `copy` before the
    scheduler, none after; no temp the size of the cache).

    **Arguments:** the program, the order, its liveness, `aliased` (interval ids of outputs in
    donated arguments' allocations); `sources`: per such interval id, the donated argument
    (a value) whose allocation it takes.

    **Returns:** (start, end, size) spans over positions of `order`.
    """
    pos = {oi: p for p, oi in enumerate(order)}
    outvars = {v for v in g.outvars if isinstance(v, int)}
    spans = []
    for iv in live.intervals:
        if iv.id not in aliased or iv.kind != "output":
            continue
        written = [pos[g.producer[v]] for v in iv.members if v in outvars and g.producer[v] in pos]
        earlier = [v for v in iv.members if v not in outvars and g.producer[v] in pos
                   and (not written or pos[g.producer[v]] < min(written))]
        if not earlier or not written:
            continue
        if DONATED_UPDATE_CHAIN and sources and iv.id in sources and _updates_of(g, pos, sources[iv.id], iv.members):
            continue
        spans.append((iv.start, min(written), iv.size))
    return spans


# On, measured with the other three (see GEMM_PROLOGUE_INPUT_WORTH and `donated_output_prefix_spans`).
DONATED_UPDATE_CHAIN = True


def _updates_of(g: Program, pos: dict[int, int], arg: int, members: Sequence[int]) -> bool:
    """Whether `members` (one buffer's values) are `arg` updated in place op after op: each made
    by an update op (dynamic_update_slice, scatter) whose operand 0 is the one before it, the
    first over `arg`, and `arg` read by nothing scheduled after that first update."""
    made = sorted((pos[g.producer[v]], v) for v in members if g.producer[v] in pos)
    if not made:
        return False
    prev = arg
    for p, v in made:
        op = g.ops[g.producer[v]]
        if storage_rule(op.primitive) != "update" or not op.operands or op.operands[0] != prev:
            return False
        prev = v
    first = made[0][0]
    return all(pos.get(r, -1) <= first for r in g.users[arg])


# gpu_compiler.cc: DotMerger(max_size_to_merge = 32 MiB): dots sharing an operand are one dot
# (its operands concatenated) when one of them reads and writes less than this.
DOT_MERGE_BYTES = 32 << 20
# triton_fusion_analysis.h: kMaxParameterPerDotOperand, the parameters a GEMM fusion reads per operand.
GEMM_PARAMETERS_PER_OPERAND = 4


def merged_dots(g: Program, order: Sequence[int]) -> list[list[int]]:
    """Groups of GEMMs XLA:GPU's dot merger makes one dot (dot_merger.cc): same shared operand
    (first or second), same dimension numbers and shapes, each small enough, every other
    operand ready when the first of them runs. Returns op indices per group (2 or more)."""
    pos = {oi: p for p, oi in enumerate(order)}
    buckets: dict[tuple, list[int]] = {}
    for oi in order:
        op = g.ops[oi]
        if op.primitive != "dot_general" or len(op.operands) != 2 or dot_kind(op, g) != "gemm":
            continue
        a, b = op.operands
        if not (isinstance(a, int) and isinstance(b, int)):
            continue
        out = op.outputs[0]
        if out is None or g.nbytes[a] + g.nbytes[b] + g.nbytes[out] > DOT_MERGE_BYTES:
            continue
        dims = repr(op.params["dimension_numbers"])
        buckets.setdefault((0, a, dims, g.shapes[b], g.dtypes[b]), []).append(oi)
        buckets.setdefault((1, b, dims, g.shapes[a], g.dtypes[a]), []).append(oi)
    groups, taken = [], set()
    for (side, _, _, _, _), members in buckets.items():
        members = [m for m in members if m not in taken]
        if len(members) < 2:
            continue
        first = pos[members[0]]
        ready = []
        for m in members:
            other = g.ops[m].operands[1 - side]
            made = g.producer[other]
            if made < 0 or pos.get(made, first) < first:
                ready.append(m)
        outs = {g.ops[m].outputs[0] for m in ready}
        ready = [m for m in ready if not any(u in outs for u in g.ops[m].inputs)]
        if len(ready) >= 2:
            groups.append(ready)
            taken.update(ready)
    return groups


def concatenated_operand_spans(g: Program, order: Sequence[int], groups: list[list[int]]) -> list[tuple[int, int, int]]:
    """The merged dot's other operands, concatenated into one buffer that the merged GEMM reads
    (dot_merger.cc concatenates them), where the concatenation cannot be read inside the Triton
    GEMM: a GEMM fusion takes at most 4 parameters per operand
    (TritonFusionAnalysis::kMaxParameterPerDotOperand), so with more than 4 merged dots the
    concatenate is its own fusion, its result stored (parallel_branches' dump: a
    `wrapped_concatenate` of eight towers' weights, arguments though they are); with 4, the
    GEMM reads them directly (the dump of `tests/gpu/fusion_programs.py:merged_dots`). Live
    while the merged dot runs, beside its result.

    **Returns:** (start, end, size) spans over positions of `order` (the merged order).
    """
    pos = {oi: p for p, oi in enumerate(order)}
    spans = []
    for grp in groups:
        if len(grp) <= GEMM_PARAMETERS_PER_OPERAND:
            continue
        first = [g.ops[m].operands for m in grp]
        shared = set(first[0]).intersection(*map(set, first[1:]))
        size = sum(align(g.nbytes[u]) for ops in first for u in ops if isinstance(u, int) and u not in shared)
        at = pos.get(grp[0])
        if size and at is not None:
            spans.append((at, at, size))
    return spans


def _merged_order(order: list[int], groups: list[list[int]]) -> list[int]:
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


def _merge_intervals(g: Program, live: Any, groups: list[list[int]]) -> list[Any]:
    """The liveness intervals with each merged group's results as one buffer: from the merged
    dot to the last read of any of its slices."""
    if not groups:
        return live.intervals
    from jaxmem.compiler.liveness import Interval

    drop: set[int] = set()
    extra = []
    for grp in groups:
        ids = {live.group[g.ops[m].outputs[0]] for m in grp}
        ids.discard(-1)
        members = [iv for iv in live.intervals if iv.id in ids and iv.kind == "temp"]
        if len(members) < 2:
            continue
        drop.update(iv.id for iv in members)
        extra.append(Interval(-1 - len(extra), [v for iv in members for v in iv.members],
                              min(iv.start for iv in members), max(iv.end for iv in members),
                              sum(iv.size for iv in members), "temp"))
    return [iv for iv in live.intervals if iv.id not in drop] + extra


def assign_temps(intervals: Sequence[Any], aliased: set[int] = frozenset()) -> int:
    """Temp bytes after XLA's buffer assignment of these liveness intervals (see
    `heap_after_reuse`; the heap is placed by best fit)."""
    return _place(heap_after_reuse(intervals, aliased))


def _place(heap: list[tuple[int, int, int]]) -> int:
    """The temp block's size: the heap placed as XLA's heap simulator places it
    (`gpu_heap.xla_heap_size`), fragmentation included."""
    from jaxmem.xla.gpu_heap import xla_heap_size

    return xla_heap_size(heap)


def heap_after_reuse(intervals: Sequence[Any], aliased: set[int] = frozenset()) -> list[tuple[int, int, int]]:
    """XLA's buffer assignment of temporaries (buffer_assignment.cc, AssignBuffersForComputations):
    buffers in decreasing size; each first tries an existing allocation (the smallest first)
    that is large enough and holds nothing live at the same time: the output allocations,
    which live only from their value's definition to the end. What is left goes to the heap
    simulator (global decreasing-size best fit); the heap's size is the temp figure.

    **Arguments:** liveness intervals (`liveness.Interval`); `aliased`, interval ids of outputs
    that live in a donated argument's allocation (not reusable).

    **Returns:** the (start, end, size) spans left for the heap.
    """
    outputs = [iv for iv in intervals if iv.kind == "output" and iv.id not in aliased]
    # Smallest first; among equal sizes the later interval first (the order tried before).
    outputs = list(reversed(sorted(outputs, key=lambda iv: -iv.size)))
    sizes = [iv.size for iv in outputs]
    # Per allocation its busy spans, disjoint, kept sorted by start: an overlap test is two
    # neighbours found by bisection, not a scan over every span.
    starts = [[iv.start] for iv in outputs]
    ends = [[iv.end] for iv in outputs]
    heap: list[tuple[int, int, int]] = []
    temps = sorted((iv for iv in intervals if iv.kind in ("temp", "scratch") and iv.size),
                   key=lambda iv: (-iv.size, iv.start))
    for iv in temps:
        for k in range(bisect.bisect_left(sizes, iv.size), len(outputs)):
            at = bisect.bisect_left(starts[k], iv.start)
            if at > 0 and ends[k][at - 1] >= iv.start:
                continue
            if at < len(starts[k]) and starts[k][at] <= iv.end:
                continue
            starts[k].insert(at, iv.start)
            ends[k].insert(at, iv.end)
            break
        else:
            heap.append((iv.start, iv.end, iv.size))
    return heap


# -- jaxmem's own plan on a GPU target -----------------------------------------------------------

def gpu_plan_fusion(g: Program, roles: Roles, forced: Sequence[bool] | None = None) -> list[bool]:
    """The fusion base of jaxmem's own GPU plan: XLA:GPU's rules (`gpu_fusion`), then GEMM
    epilogues (`fusion.gemm_epilogues`: a GEMM result only a sum reads is added in the GEMM)."""
    from jaxmem.compiler.fusion import gemm_epilogues

    return gemm_epilogues(g, roles, gpu_fusion(g, roles, forced))


def gpu_plan_output_epilogues(g: Program, roles: Roles, forced: Sequence[bool] | None = None) -> list[bool]:
    """`gpu_plan_fusion` with every GEMM's elementwise epilogue chain written by the GEMM
    (`gemm_output_epilogues`, as XLA:GPU's GEMM fusion does): a weight's SGD update is written
    from the gradient's GEMM, which is never stored. A second base for `plan_on_gpu`, not the
    only one: storing each chain's last value, which the first base may compute inside its
    readers, held more on transformer_train (161.8 against 145.8 MiB)."""
    return gemm_output_epilogues(strength_reduced(g), roles, gpu_plan_fusion(g, roles, forced), None)


def plan_on_gpu(cpu_plan: Any) -> Any:
    """jaxmem's plan for a GPU target: the program planned again with XLA:GPU's fusion rules as
    the fusion base (`gpu_fusion`: gathers, broadcasts, elementwise prologues computed inside
    their consumers), the lower of that and `cpu_plan` kept. Both are checked plans that run on
    the host: a fused value is computed as a transient right before each consumer.

    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.compiler.planner import plan
    >>> def step(w, x):   # one SGD step
    ...     return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> p = plan_on_gpu(plan(step, jnp.ones((64, 64)), jnp.ones((8, 64)), xla=False))
    >>> p.peak_bytes, p.valid
    (36864, True)

    **Arguments:** `cpu_plan`, the plan `compiler.planner.plan` made (its jaxpr and donation
    are reused: nothing is traced again).

    **Returns:** the plan with the lower peak (its `plan_seconds` counts both).
    """
    from jaxmem.compiler.planner import plan_jaxpr

    donated = [k in set(cpu_plan.donated) for k in range(len(cpu_plan.invars))]
    gpu = plan_jaxpr(cpu_plan.closed_jaxpr, donated=donated, base_fusion=gpu_plan_fusion)
    seconds = cpu_plan.plan_seconds + gpu.plan_seconds
    if _takes_output_epilogues(cpu_plan.closed_jaxpr, donated):
        # the vmapped ensemble's SGD step: 1.21x XLA:GPU's total without it, 0.98x with it
        epi = plan_jaxpr(cpu_plan.closed_jaxpr, donated=donated, base_fusion=gpu_plan_output_epilogues)
        seconds += epi.plan_seconds
        if epi.valid and epi.peak_bytes < gpu.peak_bytes:
            gpu = epi
    if gpu.peak_bytes < cpu_plan.peak_bytes and gpu.valid:
        return replace(gpu, plan_seconds=seconds, trace_seconds=cpu_plan.trace_seconds, xla=cpu_plan.xla,
                       scheduler=gpu.scheduler + "+gpu-fusion")
    return replace(cpu_plan, plan_seconds=seconds)


def _takes_output_epilogues(closed_jaxpr: Any, donated: Sequence[bool]) -> bool:
    """Whether a GEMM of the program has an epilogue chain that `gpu_plan_output_epilogues`
    would write from the GEMM and that ends in a program output (an SGD update of a weight):
    where the second GPU plan can hold less. Other chains (a bias and activation read by the
    next GEMM) are left to the first plan, which computes them inside their readers; making the
    second plan for them too doubled the GPU plan's time on transformer_train_12."""
    from jaxmem.compiler import planner

    g = planner.inlined(closed_jaxpr)
    roles = planner._roles(g, list(donated) + [False] * max(0, len(g.invars) - len(donated)), (), ())
    base = gpu_plan_fusion(g, roles, forced_fusion(g, roles))
    epi = gemm_output_epilogues(strength_reduced(g), roles, base, None)
    for op in g.ops:
        v = op.outputs[0] if op.primitive == "dot_general" and op.outputs else None
        if v is None or base[v] or not epi[v]:
            continue
        while epi[v] and len(g.users[v]) == 1:   # along the chain the GEMM now writes
            v = g.ops[g.users[v][0]].outputs[0]
        if v is not None and roles.outputs[v]:
            return True
    return False


def predict_plan(plan: Any, device: str) -> Prediction:
    """`predict` for the program a `Plan` was made from (its jaxpr and donation)."""
    donated = [k in set(plan.donated) for k in range(len(plan.invars))]
    return predict(plan.closed_jaxpr, donated=donated, device=device)
