"""The concatenate rules of the XLA:GPU model: a concatenate that a Triton GEMM computes
inside its operand fusion, cloned into each GEMM that can take it, and so never stored for
it; the gathers those GEMMs read, stored and computed together by sibling multi-output fusion.

`cloned_gemm_concats` is registered in `fusion.FUSION_RULES`, `sibling_gather_spans`
is read by `heap.cloned_concat_operand_spans` (`SPAN_ADJUSTMENTS`).
"""

from __future__ import annotations

from typing import Any, Sequence

from jaxmem.compiler.program import Program
from jaxmem.compiler.stages import align
from jaxmem.xla.gpu.model.ops import FusionContext, dot_kind, elements, float_bytes
from jaxmem.xla.gpu.model.splitk import pads_contraction

# triton_tiling_propagation.cc, GetPropagatedDimOrders: kMinConcatFragmentSize, the tile size
# each concatenated operand's extent along the concatenated dimension must be a multiple of.
MIN_CONCAT_FRAGMENT = 64


def cloned_gemm_concats(ctx: FusionContext, fused: list[bool]) -> dict[int, bool]:
    """A concatenate a GEMM reads along that operand's non-contracting dimension is computed
    inside the GEMM: XLA:GPU's GEMM fusion (xla/service/gpu/transforms/gemm_fusion.cc, run as
    "triton-gemm-rewriter" before priority fusion) propagates the operand's tiling through it
    (xla/service/gpu/triton_tiling_propagation.cc, GetPropagatedDimOrders, kConcatenate output
    to input: `concat_supported_by_gemm`) and clones it into each GEMM fusion that reads it, so
    a weight gradient `concat([e, h[s], h[r]]).T @ dy` reads the pieces, not the concatenation
    (`tests/gpu/fusion_programs.py:concat_read_by_weight_gradient`: one `gemm_fusion_dot` holds
    the concatenate; the forward GEMM, which contracts over the concatenated dimension, reads
    an `input_concatenate_fusion` scheduled right before it).

    The concatenate is then fused (its operands live until its last GEMM); no producer is
    fused into a concatenate inside a GEMM ("No fusion into concatenations", the same
    function), so an operand computed from a transcendental stays stored, the GEMM reading it
    as a parameter (the dump's `wrapped_tanh`); a cheap one (a gather) XLA recomputes in a
    loop fusion of its own right before the GEMM, and the model leaves it inside."""
    g = ctx.g
    changes: dict[int, bool] = {}
    for op in g.ops:
        if op.primitive != "concatenate" or len(op.outputs) != 1 or op.outputs[0] is None:
            continue
        v = op.outputs[0]
        if fused[v] or ctx.roles.outputs[v] or ctx.roles.external[v] or not g.users[v]:
            continue
        if not cloned(g, op, ctx.device):
            continue
        changes[v] = True
        for u in op.inputs:
            if fused[u] and (ctx.costly[u] or ctx.tainted[u]):
                changes[u] = False
    return changes


def cloned(g: Program, concat: Any, device: str | None) -> bool:
    """Whether a GEMM reading `concat` computes it inside (`concat_supported_by_gemm`)."""
    v = concat.outputs[0]
    return any(concat_supported_by_gemm(g, concat, g.ops[c], device) for c in g.users[v])


def concat_copy_scratch(g: Program, op: Any, device: str) -> int:
    """The bytes of the concatenation a reader of a cloned concatenate (`cloned_gemm_concats`)
    reads stored: one that does not take it inside (a forward GEMM contracting over the
    concatenated dimension) reads an `input_concatenate_fusion` XLA's scheduler runs right
    before it, live while it runs (`tests/gpu/fusion_programs.py:concat_read_by_weight_gradient`)."""
    extra = 0
    for u in dict.fromkeys(x for x in op.inputs if isinstance(x, int)):
        made = g.producer[u]
        if made < 0 or g.ops[made].primitive != "concatenate" or len(g.ops[made].outputs) != 1:
            continue
        concat = g.ops[made]
        if op.primitive == "dot_general" and concat_supported_by_gemm(g, concat, op, device):
            continue
        if op.primitive == "dot_general" and cloned(g, concat, device):
            extra += g.nbytes[u]
    return extra


def concat_supported_by_gemm(g: Program, concat: Any, dot: Any, device: str | None) -> bool:
    """Whether GEMM fusion takes `concat` into `dot`'s operand fusion
    (triton_tiling_propagation.cc, GetPropagatedDimOrders for kConcatenate): the dot is a GEMM
    of a floating type Triton computes (not float64); the concatenated dimension is that
    operand's only non-contracting, non-batch dimension of more than one element ("Unsupported
    concatenation", "Concatenations on split non-contracting dimensions are unsupported");
    every piece's extent along it is a multiple of `MIN_CONCAT_FRAGMENT` ("At least one operand
    of concatenation can not be perfectly tiled"). On `device`, a GEMM whose contraction the
    split-K rewriter pads (xla/service/gpu/transforms/split_k_gemm_rewriter.cc,
    PadDotOperandsIfNeededForSplitK; `splitk.pads_contraction`) reads a stored, padded
    copy of the concatenation instead (a `loop_pad_fusion` of the `input_concatenate_fusion`;
    `tests/gpu/fusion_programs.py:concat_read_by_padded_split_gemm`)."""
    v = concat.outputs[0]
    if dot.primitive != "dot_general" or dot_kind(dot, g) != "gemm" or dot.operands.count(v) != 1:
        return False
    if float_bytes(g.dtypes[v]) not in (1, 2, 4):
        return False
    side = dot.operands.index(v)
    if side > 1:
        return False
    (contracting, batch) = dot.params["dimension_numbers"]
    taken = set(contracting[side]) | set(batch[side])
    shape = g.shapes[v]
    free = [d for d in range(len(shape)) if d not in taken and shape[d] > 1]
    dim = concat.params["dimension"]
    if free != [dim]:
        return False
    if device and pads_contraction(g, dot, device):
        return False
    return all(isinstance(u, int) and g.shapes[u][dim] % MIN_CONCAT_FRAGMENT == 0 for u in concat.operands)


def recomputed_concat_operands(g: Program, fused: Any, device: str) -> dict[int, list[int]]:
    """Per GEMM op that computes a cloned concatenate inside (`cloned_gemm_concats`), the
    gathers the model leaves fused into it: XLA fuses no producer into a concatenate inside a
    GEMM ("No fusion into concatenations", triton_tiling_propagation.cc), so priority fusion
    (xla/service/gpu/transforms/priority_fusion.cc) makes each gather a loop fusion of its own
    whose result the GEMM reads as a parameter (the dump of
    `tests/gpu/fusion_programs.py:sibling_gathers_of_residual_edge_layers`: each weight
    gradient's `gemm_fusion_dot` reads `e` and two `f32[E,1,128]` gathers). A gather reads
    each row many times and is not a producer the model stores for other readers; the
    forward GEMM's copy of the concatenation computes it inside (`concat_copy_scratch`)."""
    reads: dict[int, list[int]] = {}
    for op in g.ops:
        if op.primitive != "dot_general":
            continue
        for v in dict.fromkeys(x for x in op.operands[:2] if isinstance(x, int)):
            made = g.producer[v]
            if made < 0 or not fused[v] or g.ops[made].primitive != "concatenate":
                continue
            concat = g.ops[made]
            if len(concat.outputs) != 1 or not concat_supported_by_gemm(g, concat, op, device):
                continue
            for u in concat.operands:
                if isinstance(u, int) and fused[u] and g.producer[u] >= 0 and g.ops[g.producer[u]].primitive == "gather":
                    reads.setdefault(op.index, []).append(u)
    return reads


def sibling_gather_spans(g: Program, order: Sequence[int], fused: Any, device: str) -> list[tuple[int, int, int]]:
    """The stored operands of cloned concatenates (`recomputed_concat_operands`), live from
    where XLA computes them to their last GEMM. Loop fusions that read a common operand are
    siblings, and XLA's multi-output fusion (xla/service/gpu/transforms/multi_output_fusion.cc,
    MultiOutputFusion::FuseSiblings: fusion users of one operand, an effective scalar being no
    profitable operand, not connected to each other, with compatible loop shapes,
    ShapesCompatibleForMultiOutputFusion) merges them into one kernel, which runs before the
    first GEMM that reads any of them, so every output is live from there
    (`tests/gpu/fusion_programs.py:sibling_gathers_of_residual_edge_layers`: one
    `loop_gather_fusion` of the backward's six gathers, live from before the last layer's
    weight gradient). A gather whose operands are computed after that kernel would make a
    cycle and does not join it: it runs right before its own GEMM.

    **Returns:** (start, end, size) spans over positions of `order`."""
    pos = {oi: p for p, oi in enumerate(order)}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for oi, values in recomputed_concat_operands(g, fused, device).items():
        if oi in pos:
            for u in values:
                first[u] = min(first.get(u, pos[oi]), pos[oi])
                last[u] = max(last.get(u, pos[oi]), pos[oi])
    spans = []
    kernels: list[tuple[int, set[int], int]] = []   # (position, operands read, loop elements)
    for u in sorted(first, key=lambda w: (first[w], w)):
        reads = _stored_reads(g, u, fused)
        ready = max((pos.get(g.producer[x], -1) for x in reads), default=-1)
        start = first[u]
        for k, (at, shared, size) in enumerate(kernels):
            if reads & shared and size == elements(g.shapes[u]) and ready < at:
                kernels[k] = (at, shared | reads, size)
                start = at
                break
        else:
            kernels.append((first[u], reads, elements(g.shapes[u])))
        spans.append((start, last[u], align(g.nbytes[u])))
    return spans


def _stored_reads(g: Program, u: int, fused: Any) -> set[int]:
    """The stored values (and program inputs) `u`'s fused computation reads, scalars left out
    (MultiOutputFusion's IsProfitableOperand: an effective scalar is no shared operand)."""
    seen, stack, roots = set(), [u], set()
    while stack:
        w = stack.pop()
        for x in g.ops[g.producer[w]].inputs:
            if not isinstance(x, int) or x in seen:
                continue
            seen.add(x)
            if fused[x] and g.producer[x] >= 0:
                stack.append(x)
            elif elements(g.shapes[x]) > 1:
                roots.add(x)
    return roots
