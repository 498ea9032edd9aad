"""The producer rules of the XLA:GPU model's fusion pass: per value a cheap op makes, whether
XLA:GPU keeps it stored rather than computing it inside each of its readers.

Each rule is `(context, fused, op, v) -> bool` (True: `v` stays stored), registered in order in
`fusion.PRODUCER_RULES`; the pass (`fusion.fuse_cheap_producers`) fuses a
value no rule keeps stored. The facts they share are computed here too (`tainted`,
`updates_read_inside`, `input_worth_fusing`).
"""

from __future__ import annotations

from typing import Any

from jaxmem.compiler.program import Program
from jaxmem.compiler.rules import GPU_EXPENSIVE, GPU_STORED_FOR_GEMM, GPU_VIEWS, MAX_FUSED_READERS
from jaxmem.compiler.stages import Roles
from jaxmem.xla.gpu.model.fusion_cost import duplicated, sum_of_stored_values
from jaxmem.xla.gpu.model.ops import (DOTS, ELEMENTWISE, FUSIBLE_PRODUCERS, IO_TOLERANCE_BYTES, FusionContext,
                                      absorbs, elements, read_by_gemm)


def tainted_values(g: Program) -> list[bool]:
    """Per value, whether it is computed from a transcendental op through elementwise ops and
    data movement alone. XLA:GPU's GEMM fusion runs before priority fusion, on the unfused
    program, and takes no such chain into a GEMM's operand (transformer_train's dumps: gelu's
    output is stored on both devices, whether its tanh is stored, on A100, or recomputed, on
    H100; mlp_deep_train's silu outputs likewise)."""
    tainted = [False] * g.num_values
    for op in g.ops:
        hit = op.primitive in GPU_EXPENSIVE or (op.primitive in FUSIBLE_PRODUCERS
                                                and any(tainted[u] for u in op.inputs))
        if hit:
            for w in op.outputs:
                if w is not None:
                    tainted[w] = True
    return tainted


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
        if all(absorbs("dynamic_update_slice", g.ops[c].primitive, k)
               for c in g.users[v] for k, u in enumerate(g.ops[c].operands) if u == v):
            found.add(op.index)
    return found


def input_worth_fusing(g: Program, op: Any) -> bool:
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
    n = elements(g.shapes[w])

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
            read += g.nbytes[u] * n // max(1, elements(g.shapes[u]))
        else:
            read += g.nbytes[w]
    if read - g.nbytes[w] <= IO_TOLERANCE_BYTES:
        return True
    if len(g.users[w]) > 1:
        return False
    return all(not isinstance(u, int) or (g.producer[u] < 0 and len(g.users[u]) == 1) for u in op.operands)


def too_many_readers(ctx: FusionContext, fused: list[bool], op: Any, v: int) -> bool:
    """A value with more than `MAX_FUSED_READERS` readers is stored. jaxmem's own bound, shared
    with the planner's fusion model (compiler/rules.py): priority fusion
    (xla/service/gpu/transforms/priority_fusion.cc) prices each consumer, and a value read by
    many kernels (a transformer's residual stream) is stored there too."""
    return len(ctx.g.users[v]) > MAX_FUSED_READERS


def reread_by_its_readers(ctx: FusionContext, fused: list[bool], op: Any, v: int) -> bool:
    """A cheap value a reader re-reads many times per element (a broadcast into a reduction)
    is stored where XLA:GPU's performance model finds that faster (priority_fusion.cc with
    gpu_performance_model.cc; `fusion_cost.reread_stored`). Only with
    `store_reread_producers`: `predict` leaves it off, since with it XLA's memory scheduler
    picks its post-order sequence, which the scheduling pass does not model."""
    return v in ctx.reread


def new_movement_read_by_gemm(ctx: FusionContext, fused: list[bool], op: Any, v: int) -> bool:
    """The result of a newer JAX movement primitive (`tile`, `stack`, `split`, `unstack`,
    `empty`: the `gpu_stored_for_gemm` column) that a GEMM reads through reshapes and
    transposes stays stored: XLA computes the slice in a loop fusion with the layout ops after
    it and stores that (the same bytes), and the GEMM reads the copy (a split of a fused qkv
    projection into heads: `loop_transpose_fusion`, op_name split, f32[4,8,512,64] each;
    xla/service/gpu/transforms/gemm_fusion.cc takes no slice of a multi-output split)."""
    return op.primitive in GPU_STORED_FOR_GEMM and read_by_gemm(ctx.g, v, through=GPU_VIEWS)


def reader_does_not_absorb(ctx: FusionContext, fused: list[bool], op: Any, v: int) -> bool:
    """A value is fused only where every reader computes it inside (`ops.absorbs`:
    xla/service/gpu/gpu_fusible.cc IsFusible and the consumer side of priority_fusion.cc;
    gemm_fusion.cc for GEMM operands): a loop, reduction or scatter kernel takes any cheap
    producer, a GEMM layout ops, converts, gathers, slices and elementwise ops, an in-place
    update's buffer none (a dynamic_update_slice's buffer only when the update itself is read
    inside its readers, `updates_read_inside`)."""
    g = ctx.g
    for c in g.users[v]:
        cop = g.ops[c]
        for k, u in enumerate(cop.operands):
            if u == v and not absorbs(op.primitive, cop.primitive, k, c in ctx.updates_inside):
                return True
    return False


def _into_gemm(g: Program, v: int) -> bool:
    return any(g.ops[c].primitive in DOTS for c in g.users[v])


def transcendental_into_gemm(ctx: FusionContext, fused: list[bool], op: Any, v: int) -> bool:
    """A chain holding a transcendental is never a GEMM's prologue: XLA:GPU's GEMM fusion
    (xla/service/gpu/transforms/gemm_fusion.cc) runs before priority fusion and takes no
    expensive op (HloInstruction::IsExpensive) into a GEMM's operand (mlp_deep_train's silu
    outputs, transformer_train's gelu: stored)."""
    return (ctx.costly[v] or ctx.tainted[v]) and _into_gemm(ctx.g, v)


def gemm_prologue_not_worth_fusing(ctx: FusionContext, fused: list[bool], op: Any, v: int) -> bool:
    """An elementwise op a GEMM reads (directly or through a folded transpose) that GEMM fusion
    does not find worth taking into the operand is stored and the GEMM reads it
    (triton_tiling_propagation.cc: IsInputWorthFusing; `input_worth_fusing`). XLA's choice,
    not a need: jaxmem's own plan (no device) keeps it in the GEMM's operand."""
    g = ctx.g
    return (ctx.dev is not None and (_into_gemm(g, v) or read_by_gemm(g, v))
            and not input_worth_fusing(g, op))


def transcendental_not_duplicated(ctx: FusionContext, fused: list[bool], op: Any, v: int) -> bool:
    """A fused chain holding a transcendental, read by several kernels, is stored unless the
    device's performance model finds computing it in each faster (priority_fusion.cc:
    CalculateProducerPriority; `fusion_cost.duplicated`). Without a device
    (jaxmem's own plan) it is stored, which is valid."""
    if not (ctx.costly[v] and len(ctx.g.users[v]) > 1):
        return False
    return not (ctx.dev is not None and duplicated(ctx.g, ctx.roles, fused, ctx.tainted, ctx.dev, v, ctx.reread))


def narrowing_cast_shared(ctx: FusionContext, fused: list[bool], op: Any, v: int) -> bool:
    """A narrowing cast (float32 -> bfloat16) read by a GEMM and by something else is stored.

    XLA's GEMM fusion takes an operand's producer only if it is worth it (IsInputWorthFusing in
    xla/service/gpu/transforms/gemm_fusion.cc / triton_tiling_propagation.cc): one that reads
    more bytes than it writes (beyond 1 KiB) must have a single user. A weight cast to bfloat16
    for the forward GEMM and the backward one fails that, so the cast is its own fusion and its
    result is stored (bf16_train's dump: `wrapped_convert` of each weight;
    `tests/gpu/fusion_programs.py:bf16_weight_read_twice`). Read by one GEMM alone it is
    computed inside it (`bf16_convert_into_gemm`). Only with `store_shared_casts`: jaxmem's own
    plan computes the cast in each reader, which is valid and holds less.
    """
    if not ctx.store_shared_casts:
        return False
    g = ctx.g
    if op.primitive != "convert_element_type" or len(g.users[v]) < 2 or not op.inputs:
        return False
    if g.nbytes[op.inputs[0]] - g.nbytes[v] <= IO_TOLERANCE_BYTES:
        return False
    return _into_gemm(g, v)


def read_by_slow_reduction(ctx: FusionContext, fused: list[bool], op: Any, v: int) -> bool:
    """A cheap elementwise value that a column reduction on few blocks reads is stored where the
    device's performance model finds that faster than computing it in the reduction
    (`fusion_cost.slow_reduction_stored`: priority_fusion.cc prices the reduction's
    bandwidth by its blocks). Only with a device (the prediction)."""
    return v in ctx.slow_stored


def stored_sum_read_by_several(ctx: FusionContext, fused: list[bool], op: Any, v: int) -> bool:
    """A sum of stored values is stored where XLA:GPU's performance model, pricing it against
    the ops that read it, finds that faster than computing it in each (priority_fusion.cc,
    CalculateProducerPriority; `fusion_cost.sum_of_stored_values`): a pre-LayerNorm
    residual stream's sums, not a ResNet's `bn + shortcut` read by a relu and its mask.
    Without a device (jaxmem's own plan) it is computed in its readers."""
    return ctx.dev is not None and sum_of_stored_values(ctx.g, ctx.roles, fused, ctx.tainted, ctx.dev,
                                                        ctx.reread, op, v)
