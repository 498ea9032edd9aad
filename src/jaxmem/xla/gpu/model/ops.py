"""What every pass of the XLA:GPU model (`predict`) and the split-K rewrite (`splitk`) reads
of a program: the primitive classes (derived from `compiler.rules`), the dots as XLA:GPU's
algebraic simplifier and dot merger leave them, which consumer computes which producer inside
it, and the context the fusion rules share (`FusionContext`). It imports no other pass."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from jaxmem.compiler.program import Program
from jaxmem.compiler.rules import (DOT_LIKE, GPU_ELEMENTWISE, GPU_FUSIBLE_PRODUCERS, GPU_GEMM_LAYOUT,
                                   GPU_GEMM_OPERAND, GPU_LOOP_CONSUMERS, GPU_MOVEMENT, GPU_REDUCTIONS,
                                   GPU_SCATTER_IN_PLACE, GPU_VIEWS)
from jaxmem.compiler.stages import Roles

ELEMENTWISE = GPU_ELEMENTWISE
MOVEMENT = GPU_MOVEMENT
REDUCTIONS = GPU_REDUCTIONS
DOTS = DOT_LIKE
FUSIBLE_PRODUCERS = GPU_FUSIBLE_PRODUCERS
# Consumers that are loop, input (reduction) or scatter/in-place fusions: they absorb any
# fusible producer.
LOOP_CONSUMERS = GPU_LOOP_CONSUMERS
# The primitive name a Triton softmax fusion's op gets in the model's program (`no_inplace`):
# no rule of `compiler.rules` applies to it, so its output takes over no operand's buffer.
TRITON_ROW_FUSION = "gpu_row_fusion"
# gemm_fusion.cc / triton_fusion_analysis.cc: kIoToleranceBytes, how much an operand fused into a
# GEMM may shrink its data without further conditions.
IO_TOLERANCE_BYTES = 1024
# gpu_compiler.cc: DotMerger(max_size_to_merge = 32 MiB): dots sharing an operand are one dot
# (its operands concatenated) when one of them reads and writes less than this.
DOT_MERGE_BYTES = 32 << 20


@dataclass
class FusionContext:
    """What the fusion rules (`fusion.FUSION_RULES`, `PRODUCER_RULES`) read: the
    program as XLA:GPU's simplifier leaves it (`strength_reduced`), the values' roles, the
    device (None: jaxmem's own plan) and its performance-model numbers (`performance.Device`),
    and per-value facts the driver keeps: `costly` (a fused chain holding a transcendental),
    `tainted` (computed from a transcendental through cheap ops), `reread` (cheap values the
    performance model stores), `updates_inside` (dynamic_update_slice ops computed in their
    readers), `slow_stored` (cheap values a column reduction on few blocks would read slowly)."""

    g: Program
    roles: Roles
    device: str | None
    dev: Any
    store_shared_casts: bool
    output_epilogues: bool
    costly: list[bool] = field(default_factory=list)
    tainted: list[bool] = field(default_factory=list)
    reread: set[int] = field(default_factory=set)
    updates_inside: set[int] = field(default_factory=set)
    slow_stored: set[int] = field(default_factory=set)


def elements(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def float_bytes(dtype: Any) -> int:
    """Bytes per element of a floating dtype; 0 for any other."""
    name = str(dtype)
    if not (name.startswith("float") or name.startswith("bfloat")):
        return 0
    digits = "".join(ch for ch in name if ch.isdigit())
    return int(digits[:2]) // 8 if digits else 0


def kernel_space(g: Program, op: Any) -> int:
    """Elements a loop, reduction or scatter kernel rooted at `op` runs over: the largest of its
    inputs and outputs (a reduction runs over its input, a scatter over its updates, a
    strength-reduced matvec over the broadcast product of its operands)."""
    sizes = [elements(g.shapes[u]) for u in op.inputs]
    sizes += [elements(g.shapes[w]) for w in op.outputs if w is not None]
    return max(sizes, default=1)


def absorbs(producer: str, consumer: str, operand_index: int, update_read_inside: bool = False) -> bool:
    """Whether XLA:GPU computes a `producer` op inside a `consumer` reading it as operand
    `operand_index`: a Triton GEMM through its operand fusion (a convolution through layout
    views only), a loop, reduction or scatter fusion any fusible producer, except into the
    buffer an update or scatter writes in place (a dynamic_update_slice's buffer only when the
    update itself is computed inside its readers, `update_read_inside`)."""
    if consumer in DOTS:
        if consumer == "conv_general_dilated":
            return producer in GPU_VIEWS
        return producer in GPU_GEMM_OPERAND or producer in ELEMENTWISE
    if consumer == "dynamic_update_slice" and operand_index == 0:
        return update_read_inside
    if consumer in GPU_SCATTER_IN_PLACE and operand_index == 0:
        return False
    return consumer in LOOP_CONSUMERS or consumer.startswith("scatter")


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


def strength_reduced(g: Program) -> Program:
    """The program as XLA:GPU's algebraic simplifier leaves its dots: a dot_general with no
    contracting dimension (an outer product) is a multiply of broadcasts, one where a side has
    no free dimension (a batched matrix-vector product) a multiply and a reduction
    (algebraic_simplifier.cc, dot strength reduction). Both then fuse like any elementwise op or
    reduction: MoE's `einsum("td,tdf->tf", x, w1[idx])` reads the gathered weights inside a
    reduction and never stores them. A reduction over dimensions of size one only is a squeeze,
    computed inside its readers like any reshape (`_unit_reduction`). Other ops are kept; the program is not copied otherwise."""
    ops = list(g.ops)
    changed = False
    for op in g.ops:
        if _unit_reduction(g, op):
            ops[op.index] = replace(op, primitive="squeeze")
            changed = True
            continue
        if op.primitive != "dot_general" or len(op.inputs) < 1:
            continue
        kind = dot_kind(op, g)
        if kind != "gemm":
            ops[op.index] = replace(op, primitive="mul" if kind == "outer" else "reduce_sum")
            changed = True
    return replace(g, ops=ops) if changed else g


def _unit_reduction(g: Program, op: Any) -> bool:
    """Whether `op` reduces only dimensions of size one, keeping its operand's type. XLA's
    algebraic simplifier (algebraic_simplifier.cc, AlgebraicSimplifierVisitor::HandleReduce)
    replaces a reduce whose result has as many elements as its operand by a reshape of the
    operand (the init value is the reduction's identity), which XLA:GPU emits as a bitcast: a
    vmapped pool gradient's `sum` over its size-one axis reads the scatter's buffer, and nothing
    new is stored."""
    if op.primitive not in REDUCTIONS or len(op.inputs) != 1 or len(op.outputs) != 1 or op.outputs[0] is None:
        return False
    axes = op.params.get("axes")
    u, v = op.inputs[0], op.outputs[0]
    if not axes or g.dtypes[u] != g.dtypes[v]:
        return False
    return all(g.shapes[u][int(a)] == 1 for a in axes)


def read_by_gemm(g: Program, v: int, depth: int = 4, through: frozenset = GPU_GEMM_LAYOUT) -> bool:
    """Whether a GEMM reads `v`, directly or through up to `depth` layout ops XLA folds into a
    GEMM's dimension numbers (`through`: transposes; taking reshapes too stored values XLA
    computes inside the GEMM's operand): `(a - b).T @ x` reads the subtract as its operand
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


def no_inplace(g: Program, values: Sequence[int]) -> Program:
    """The program with the ops making `values` as opaque fusions (`TRITON_ROW_FUSION`): a Triton
    softmax fusion reads each row several times, so its output never takes over an operand's
    buffer."""
    ops = list(g.ops)
    for v in values:
        oi = g.producer[v]
        if oi >= 0:
            ops[oi] = replace(ops[oi], primitive=TRITON_ROW_FUSION)
    return replace(g, ops=ops)


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
