"""The XLA:GPU model's fusion pass: which values XLA:GPU never stores (computed inside each of
their readers) and which it stores, as a list of named rules run in order.

XLA:GPU fuses far more than XLA:CPU: elementwise chains become loop fusions; broadcasts,
gathers, dynamic slices, slices, transposes and reshapes are computed inside their consumers
(loop, reduction and GEMM fusions: a Triton GEMM reads `w1[idx]` through its operand fusion, so
the gathered weights are never stored); reductions and dots are fusion roots whose results are
stored. The rules:

- `FUSION_RULES`: whole-program rules, `(context, fused) -> {value: fused flag}` (the values
  they change), run in order on the flags the rules before them left. The first,
  `fuse_cheap_producers`, fuses each cheap value no producer rule keeps stored.
- `PRODUCER_RULES`: per cheap value, `(context, fused, op, value) -> bool` (True: stored), asked
  in order until one keeps it stored.

A new fusion rule of XLA:GPU is a function added to one of the two lists, with its docstring
citing the XLA pass it follows and a test in `tests/gpu/test_gpu_fusion_rules.py`. The split-K
rewrite (`splitk`), which runs after these on the prediction's path, may store more.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence

from jaxmem.compiler.fusion import forced_fusion, gemm_epilogues
from jaxmem.compiler.program import Program
from jaxmem.compiler.rules import GPU_EXPENSIVE, GPU_SLICE_PER_OUTPUT
from jaxmem.compiler.stages import Roles
from jaxmem.xla.gpu.model.performance import bf16_arithmetic_native, device_numbers
from jaxmem.xla.gpu.model.conv import conv_layouts, conv_operands_materialized, conv_side_inputs
from jaxmem.xla.gpu.model.fusion_concat import cloned_gemm_concats
from jaxmem.xla.gpu.model.fusion_cost import capped_reductions, reread_stored, slow_reduction_stored
from jaxmem.xla.gpu.model.fusion_gemm import gemm_output_epilogues, output_epilogues, shared_masks_stored
from jaxmem.xla.gpu.model.fusion_producers import (gemm_prologue_not_worth_fusing, narrowing_cast_shared,
                                                   new_movement_read_by_gemm, read_by_slow_reduction,
                                                   reader_does_not_absorb, reread_by_its_readers, tainted_values,
                                                   stored_sum_read_by_several, too_many_readers, transcendental_into_gemm,
                                                   transcendental_not_duplicated, updates_read_inside)
from jaxmem.xla.gpu.model.fusion_softmax import softmax_fusions, widened_softmax_roots_stored
from jaxmem.xla.gpu.model.ops import (ELEMENTWISE, FUSIBLE_PRODUCERS, REDUCTIONS, FusionContext,
                                      strength_reduced)

ProducerRule = Callable[[FusionContext, list, Any, int], bool]
ProgramRule = Callable[[FusionContext, list], dict]

# Asked in this order for each cheap value; the first that answers True keeps it stored.
PRODUCER_RULES: list[ProducerRule] = [
    too_many_readers,
    reread_by_its_readers,
    new_movement_read_by_gemm,
    reader_does_not_absorb,
    transcendental_into_gemm,
    gemm_prologue_not_worth_fusing,
    transcendental_not_duplicated,
    narrowing_cast_shared,
    stored_sum_read_by_several,
    read_by_slow_reduction,
]


def fuse_cheap_producers(ctx: FusionContext, fused: list[bool]) -> dict[int, bool]:
    """Each value an elementwise or data-movement op makes is computed inside its readers unless
    a producer rule (`PRODUCER_RULES`) keeps it stored: priority fusion
    (xla/service/gpu/transforms/priority_fusion.cc) and the producer side of gpu_fusible.cc's
    IsFusible, in program order (a value's chain is `costly` when a transcendental is fused
    into it). Outputs, external values and values nothing reads are never fused."""
    g, roles = ctx.g, ctx.roles
    fused = list(fused)
    changes: dict[int, bool] = {}
    for op in g.ops:
        if op.primitive in GPU_EXPENSIVE or any(fused[u] and ctx.costly[u] for u in op.inputs):
            for w in op.outputs:
                if w is not None:
                    ctx.costly[w] = True
        if op.primitive not in FUSIBLE_PRODUCERS or op.effectful:
            continue
        if len(op.outputs) != 1 and op.primitive not in GPU_SLICE_PER_OUTPUT:
            continue
        for v in op.outputs:
            if v is None or fused[v] or roles.outputs[v] or roles.external[v] or not g.users[v]:
                continue
            if any(keeps_stored(ctx, fused, op, v) for keeps_stored in PRODUCER_RULES):
                continue
            fused[v] = changes[v] = True
    return changes


# Run in this order; each sees the flags the ones before it left.
FUSION_RULES: list[ProgramRule] = [
    fuse_cheap_producers,
    cloned_gemm_concats,
    shared_masks_stored,
    conv_operands_materialized,
    conv_side_inputs,
    softmax_fusions,
    widened_softmax_roots_stored,
    output_epilogues,
]


def run_fusion_rules(ctx: FusionContext, fused: Sequence[bool]) -> list[bool]:
    """`fused` after every rule of `FUSION_RULES`, in order."""
    out = list(fused)
    for rule in FUSION_RULES:
        for v, flag in rule(ctx, out).items():
            out[v] = flag
    return out


def fusion_context(g: Program, roles: Roles, *, device: str | None, store_shared_casts: bool,
                   output_epilogues: bool, store_reread_producers: bool, fused: Sequence[bool]) -> FusionContext:
    """The rules' context for `g` (strength-reduced here) with the fusion `fused` so far."""
    g = strength_reduced(g)
    dev = device_numbers(device) if device else None
    ctx = FusionContext(g, roles, device, dev, store_shared_casts, output_epilogues,
                        costly=[False] * g.num_values)
    ctx.tainted = tainted_values(g) if dev else [False] * g.num_values
    if dev and store_reread_producers:
        ctx.reread = reread_stored(g, roles, list(fused), ctx.tainted, dev)
    ctx.updates_inside = updates_read_inside(g, roles)
    if dev:
        capped = capped_reductions(g, conv_layouts(g, device), dev)
        if capped:
            ctx.slow_stored = slow_reduction_stored(g, roles, list(fused), ctx.tainted, dev, capped)
    return ctx


def gpu_fusion(g: Program, roles: Roles, forced: Sequence[bool] | None = None,
               store_shared_casts: bool = False, device: str | None = None,
               store_reread_producers: bool = False) -> list[bool]:
    """Per value, True when XLA:GPU never stores it: computed inside each of its consumers.

    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.compiler import jaxpr_adapter as ja
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
    arguments; `fusion.forced_fusion`); `store_shared_casts`: store a narrowing cast read by a
    GEMM and another reader, and a select mask read by a GEMM and another reader, as XLA does
    (`narrowing_cast_shared`, `shared_masks_stored`); the prediction sets it, jaxmem's own plan
    (the planner's fusion base) computes them in each reader, which is valid and holds less.
    `device`: a GPU preset whose performance model decides whether a transcendental chain read
    by several loop kernels is computed in each (`transcendental_not_duplicated`), and whose
    GEMM fusion sees whole chains (a value computed from a transcendental through elementwise
    ops is never a GEMM's prologue, stored or not); None (jaxmem's own plan) stores every such
    chain, which is valid. `store_reread_producers` (with a `device`): store cheap values that a
    reader re-reads many times, as XLA does (`reread_by_its_readers`); `predict` leaves it off
    (see that rule).

    **Returns:** per value, the fused flag (outputs and loop-body results are never fused).
    """
    fused = list(forced) if forced is not None else forced_fusion(g, roles)
    ctx = fusion_context(g, roles, device=device, store_shared_casts=store_shared_casts, output_epilogues=False,
                         store_reread_producers=store_reread_producers, fused=fused)
    return run_fusion_rules(ctx, fused)


def prediction_fusion(g: Program, roles: Roles, forced: Sequence[bool] | None = None, *,
                      device: str, store_reread_producers: bool = False) -> list[bool]:
    """The prediction's fusion: every rule as XLA:GPU stores values on `device`, GEMM
    epilogues included (`output_epilogues`)."""
    fused = list(forced) if forced is not None else forced_fusion(g, roles)
    ctx = fusion_context(g, roles, device=device, store_shared_casts=True, output_epilogues=True,
                         store_reread_producers=store_reread_producers, fused=fused)
    return run_fusion_rules(ctx, fused)


def gpu_plan_fusion(g: Program, roles: Roles, forced: Sequence[bool] | None = None) -> list[bool]:
    """The fusion base of jaxmem's own GPU plan: XLA:GPU's rules (`gpu_fusion`), then GEMM
    epilogues (`fusion.gemm_epilogues`: a GEMM result only a sum reads is added in the GEMM)."""
    return gemm_epilogues(g, roles, gpu_fusion(g, roles, forced))


def gpu_plan_output_epilogues(g: Program, roles: Roles, forced: Sequence[bool] | None = None) -> list[bool]:
    """`gpu_plan_fusion` with every GEMM's elementwise epilogue chain written by the GEMM
    (`gemm_output_epilogues`, as XLA:GPU's GEMM fusion does): a weight's SGD update is written
    from the gradient's GEMM, which is never stored. A second base for `plan_on_gpu`, not the
    only one: storing each chain's last value, which the first base may compute inside its
    readers, can hold more (transformer_train)."""
    return gemm_output_epilogues(strength_reduced(g), roles, gpu_plan_fusion(g, roles, forced), None)


def stored_in_f32(g: Program, roles: Roles, fused: Sequence[bool], device: str) -> Program:
    """The program with the bytes XLA:GPU stores for bfloat16 arithmetic results on a device
    that computes bfloat16 arithmetic in float32 (`performance.bf16_arithmetic_native`; XLA's
    float normalization, xla/service/float_normalization.cc with GpuFloatSupport).

    There a bfloat16 elementwise chain runs in float32; a value of it that is stored and read
    by other elementwise ops or reductions (also run in float32) is stored as computed, in
    float32: twice its bytes (`widened_values`). bf16_train on A100: gelu's stored tanh is
    f32[4,256,1536] (6 MiB), on H100 bf16 (3 MiB), each layer; the same in
    `tests/gpu/fusion_programs.py:gelu_step_bf16` (the activation fusion's second output: f32
    on A100, bf16 on H100). A GEMM reading it too reads a bfloat16 copy (`bf16_gemm_copies`).
    """
    widened = widened_values(g, roles, fused, device)
    if not widened:
        return g
    nbytes = list(g.nbytes)
    for v in widened:
        nbytes[v] = 2 * g.nbytes[v]
    return replace(g, nbytes=nbytes)


def bf16_gemm_copies(g: Program, roles: Roles, fused: Sequence[bool], device: str) -> dict[int, int]:
    """Per value `widened_values` stores in float32 that a GEMM reads too, the bytes of its
    bfloat16 copy (`g` before `stored_in_f32`; held by `heap.bf16_copy_intervals`).
    float_normalization.cc leaves `convert(f32 -> bf16)` before each GEMM reading the float32
    value (the GEMM reads bfloat16; the simplifier drops only convert pairs): XLA stores the
    float32 value until its last float32 reader and the bfloat16 copy until its last GEMM (an
    activation gradient read by the bias gradient's reduction and the weight gradient's GEMM:
    `loop_add_fusion` f32 and `input_convert_reduce_fusion{1}` bf16, both live at the peak, in
    the A100 dump of `tests/gpu/fusion_programs.py:bf16_bias_gelu_grad`)."""
    return {v: g.nbytes[v] for v in widened_values(g, roles, fused, device)
            if any(g.ops[c].primitive == "dot_general" for c in g.users[v])}


def widened_values(g: Program, roles: Roles, fused: Sequence[bool], device: str) -> list[int]:
    """The stored bfloat16 values XLA:GPU stores in float32 on `device` (see `stored_in_f32`):
    results of bfloat16 arithmetic (not converts, whose result is their stated type, nor a
    GEMM's epilogue root, `written_by_gemm`) read by elementwise ops or reductions, and
    otherwise only by GEMMs."""
    dev = device_numbers(device) if device else None
    if dev is None or bf16_arithmetic_native(dev):
        return []
    found = []
    for op in g.ops:
        if op.primitive not in ELEMENTWISE or op.primitive == "convert_element_type" or len(op.outputs) != 1:
            continue
        v = op.outputs[0]
        if v is None or fused[v] or roles.outputs[v] or roles.external[v] or str(g.dtypes[v]) != "bfloat16":
            continue
        readers = [g.ops[c] for c in g.users[v]]
        wide = [r for r in readers if _reads_in_f32(g, r)]
        gemms = [r for r in readers if r.primitive == "dot_general"]
        if wide and len(wide) + len(gemms) == len(readers) and not written_by_gemm(g, fused, op):
            found.append(v)
    return found


def _reads_in_f32(g: Program, reader: Any) -> bool:
    """Whether `reader` of a float32-computed bfloat16 value reads it in float32: an elementwise
    op or reduction (normalized to float32 too), or a convert to float32, which
    SimplifyFPConversions removes with the bfloat16 convert before it
    (xla/hlo/transforms/simplifiers/simplify_fp_conversions.h: `f32 -> bf16 -> f32` chains,
    under xla_allow_excess_precision, on by default): LayerNorm's `x.astype(f32)` of a residual
    sum reads the float32 sum (`bf16_residual_mlp` on A100: the sums f32[32,256,256])."""
    if reader.primitive == "convert_element_type":
        out = reader.outputs[0] if len(reader.outputs) == 1 else None
        return out is not None and str(g.dtypes[out]) == "float32"
    return reader.primitive in ELEMENTWISE or reader.primitive in REDUCTIONS


def written_by_gemm(g: Program, fused: Sequence[bool], op: Any) -> bool:
    """Whether elementwise `op` is the last op of a GEMM's epilogue (`gemm_output_epilogues`:
    a fused dot reached through fused single-reader elementwise ops and transposes): its value
    is the GEMM fusion's result, written in the fusion's own type. Float normalization leaves
    a fusion (and a cuBLAS custom call) as it is (float_normalization.cc,
    FloatNormalizationVisitor::DefaultAction returns early for kFusion and kCustomCall): the
    result stays bfloat16 on A100, and readers computing in float32 convert it there. The
    bias GEMMs of `tests/gpu/fusion_programs.py:bf16_residual_mlp`:
    `gemm_fusion_dot` bf16[8192,1024] on both devices, read by the float32 gelu fusion
    (`loop_convert_tanh_fusion`) on A100."""
    todo = [u for u in op.inputs if fused[u]]
    seen: set[int] = set()
    while todo:
        u = todo.pop()
        p = g.producer[u]
        if u in seen or p < 0 or len(g.users[u]) != 1:
            continue
        seen.add(u)
        prod = g.ops[p]
        if prod.primitive == "dot_general":
            return True
        if prod.primitive in ELEMENTWISE or prod.primitive == "transpose":
            todo.extend(w for w in prod.inputs if fused[w])
    return False
