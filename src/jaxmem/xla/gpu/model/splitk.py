"""XLA:GPU's split-K rewrite of GEMMs, and the memory its partial results take.

Before GEMM fusion, XLA:GPU's `SplitkRewriter` (backends/gpu/transforms/splitk_rewriter.cc, in
the CUDA plugin that compiles here: jax 0.10.2) splits the contracting dimension of a dot into
`s` chunks: the dot becomes a batched dot with `s` times the output elements, in the
accumulator type (float32 for 16-bit inputs), followed by a reduce over the new dimension (and a
convert back to the output type). The factor comes from a cost model over the problem size and
the device's core count, the smallest estimated cost over s = 1, 2, 4, ... 2048:

    tiles   = b * s * ceil(m / 128) * ceil(n / 128), a wave being cores * 128^2 / (tm * tn)
              tiles, tm = min(m, 128), tn = min(n, 128)
    compute = 2 * tm * tn * ceil(k / s) * max(1, tiles / wave) * w_compute
    memory  = (lhs + rhs bytes + b * s * m * n * (accumulator or, unsplit, output) bytes) * w_memory
    cost    = max(compute, memory), plus for s > 1: w_launch + (the partials' bytes read and
              the result's written) * w_reduction

with per-generation weights (Blackwell, Hopper, Ampere and older). Deviceless compiles here
take it as written: 20 GEMMs (M, N, K, batch, float32 and bfloat16) on H100 and A100, 40 of 40
split as it says (`tests/gpu/test_gpu_splitk.py` keeps 14 of them), e.g. (M, N, K) =
(512, 512, 2048): 8 on H100, 4 on A100; (1024, 1024, 1024): 1; (128, 128, 8192): 64 and 32.
Deviceless, no autotuner changes it: the Triton search space sees the already split dot.
Only a dot with an s32 operand is skipped: s8 x s8 -> s32 and float8 x float8 -> f32 GEMMs split
too, their partials in XLA's default accumulator type (s32, f32; `accumulator_bits`): int8_fp8's
dumps hold s32[4,256,1024] and f32[8,256,512] on H100, s32[2,...] and f32[4,...] on A100. The
rewriter visits every non-fusion computation, so a GEMM in a while or scan body splits as well
(`scratch.loop_scratch` models bodies with this module).

The memory: the partial results f32[s, b, m, n] are the GEMM fusion's output. The reduce is a
loop fusion, which priority fusion merges into the consumers of the dot's result when they are
loop, row-reduction or softmax fusions (parallel_branches' dump: the bias-add-silu, the
concatenate and the layer norm read the partials themselves; a gather or dynamic slice of the
result, a row sum, likewise), so the partials live until those consumers run and the reduced
result is never stored. Where the result is read by another GEMM (GEMM fusion takes no reduce
into its operands), by a column reduction, or is a program output, the reduce is its own
fusion: its result is stored as before and the partials live only from the GEMM to the reduce.
A fused value downstream that several kernels read is stored rather than recomputed in each
(`_stored_readers`). GEMMs the dot merger joins (it runs first) split as one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from jaxmem.compiler.plan_types import Const
from jaxmem.compiler.program import Program
from jaxmem.compiler.rules import DOT_LIKE, GPU_HLO_REDUCE, GPU_SPLITK_ABSORBING
from jaxmem.xla.gpu.model.performance import device_numbers
from jaxmem.xla.gpu.model.ops import ELEMENTWISE, TRITON_ROW_FUSION, elements, merged_dots

# The candidate factors (ChooseSplitK).
CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
# The cost model's output tile (kMTileSize, kNTileSize).
TILE = 128
# (compute, memory, reduction memory, reduction launch) weights per compute capability major:
# GetCostWeights (Blackwell and later, Hopper, the rest).
WEIGHTS: dict[str, tuple[float, float, float, float]] = {
    "blackwell": (100.0, 0.0848863, 189.711, 1.21563e+08),
    "hopper": (100.0, 0.194136, 193.1384, 4.36e+07),
    "other": (100.0, 0.0666955, 467.815, 5.65307e+07),
}
_BITS = {"float64": 64, "float32": 32, "bfloat16": 16, "float16": 16, "int8": 8, "uint8": 8,
         "float8_e4m3fn": 8, "float8_e5m2": 8, "int32": 32, "int16": 16}
# Consumers priority fusion merges the split's reduce (a loop fusion) into: `rules.GPU_SPLITK_ABSORBING`
# and Triton softmax fusions (`ops.no_inplace` names them TRITON_ROW_FUSION).
ABSORBING = GPU_SPLITK_ABSORBING


def generation(device: str) -> str | None:
    """The cost model's weight set for a GPU preset (None: not a CUDA GPU the model knows)."""
    dev = device_numbers(device)
    if dev is None or not dev.sm.startswith("sm_"):
        return None
    major = int(dev.sm[3:-1] or 0)
    return "blackwell" if major >= 10 else "hopper" if major == 9 else "other"


def split_cost(b: int, m: int, n: int, k: int, split: int, cores: int, weights: tuple[float, float, float, float],
               lhs_bits: int = 32, rhs_bits: int = 32, acc_bits: int = 32, out_bits: int = 32,
               flops_per_element: int = 2) -> float:
    """The cost model's estimate of a (b, m, n, k) GEMM split `split` ways (see the module's text)."""
    w_compute, w_memory, w_reduction, w_launch = weights
    eff_k = -(-k // split)
    eff_b = b * split
    tm, tn = min(m, TILE), min(n, TILE)
    tiles = eff_b * -(-m // TILE) * -(-n // TILE)
    wave = cores * (TILE * TILE) / (tm * tn)
    compute = flops_per_element * tm * tn * eff_k * max(1.0, tiles / wave) * w_compute
    read = (m * k * b * lhs_bits + n * k * b * rhs_bits) / 8
    written = m * n * eff_b * (acc_bits if split > 1 else out_bits) / 8
    cost = max(compute, (read + written) * w_memory)
    if split == 1:
        return cost
    reduction = (eff_b * m * n * acc_bits + b * m * n * out_bits) / 8
    return cost + w_launch + reduction * w_reduction


def split_k(b: int, m: int, n: int, k: int, device: str, *, lhs_bits: int = 32, rhs_bits: int = 32,
            acc_bits: int = 32, out_bits: int = 32) -> int:
    """XLA:GPU's split-K factor for a GEMM of batch `b`, output m x n and contraction k on
    `device` (a jaxmem GPU preset); 1 for an unknown device.

    >>> split_k(1, 512, 512, 2048, "h100-80gb"), split_k(1, 512, 512, 2048, "a100-40gb")
    (8, 4)
    """
    gen = generation(device)
    if gen is None or min(b, m, n, k) <= 0:
        return 1
    cores = device_numbers(device).cores
    costs = [split_cost(b, m, n, k, s, cores, WEIGHTS[gen], lhs_bits, rhs_bits, acc_bits, out_bits)
             for s in CANDIDATES]
    return CANDIDATES[costs.index(min(costs))]


def _prod(values: Sequence[int]) -> int:
    out = 1
    for d in values:
        out *= d
    return out


def _side_bits(g: Program, u: Any) -> int:
    """An operand's element width after walking up single-operand elementwise ops (the
    rewriter's approximation of what GEMM fusion will read: a bfloat16 cast of a float32
    weight counts 32 bits)."""
    while isinstance(u, int) and g.producer[u] >= 0:
        op = g.ops[g.producer[u]]
        if op.primitive not in ELEMENTWISE or len(op.operands) != 1 or not isinstance(op.operands[0], int):
            break
        u = op.operands[0]
    dtype = g.dtypes[u] if isinstance(u, int) else str(getattr(getattr(u, "aval", None), "dtype", "float32"))
    return _BITS.get(str(dtype), 32)


def _dims(g: Program, op: Any) -> tuple[int, int, int, int]:
    """(b, m, n, k) of a dot_general: batch, lhs free, rhs free and contracting sizes."""
    lhs, rhs = op.operands[:2]
    (lc, rc), (lb, rb) = op.params["dimension_numbers"]
    ls, rs = g.shapes[lhs], g.shapes[rhs]
    return (_prod([ls[d] for d in lb]), _prod([ls[d] for d in range(len(ls)) if d not in lc and d not in lb]),
            _prod([rs[d] for d in range(len(rs)) if d not in rc and d not in rb]), _prod([ls[d] for d in lc]))


def dot_split(g: Program, op: Any, device: str, merged: Sequence[Any] = ()) -> int:
    """The split factor of one GEMM `dot_general` of `g` on `device` (1: not split): any
    operand type but s32, as the rewriter (8-bit integers and float8 included). `merged`: the ops of
    the dot merger's group holding `op`, if any: the merger runs first, so the rewriter sees one
    dot whose free dimension on the unshared side is the members' sum."""
    if op.primitive != "dot_general" or len(op.operands) < 2 or not all(isinstance(u, int) for u in op.operands[:2]):
        return 1
    lhs, rhs = op.operands[:2]
    out = op.outputs[0]
    # the rewriter skips a dot with an s32 operand (neither cuBLAS nor Triton takes s32); 8-bit
    # integer and float8 GEMMs split like the others (int8_fp8's dumps: s32[4,256,1024] and
    # f32[8,256,512] partials on H100)
    if out is None or any(str(g.dtypes[u]) == "int32" for u in (lhs, rhs)):
        return 1
    if not op.params["dimension_numbers"][0][0]:
        return 1
    b, m, n, k = _dims(g, op)
    if len(merged) > 1:
        shares_lhs = all(other.operands[0] == lhs for other in merged)
        total = sum(_dims(g, other)[2 if shares_lhs else 1] for other in merged)
        m, n = (m, total) if shares_lhs else (total, n)
    if m == 0 or n == 0:
        return 1
    acc = accumulator_bits(str(g.dtypes[lhs]), str(g.dtypes[rhs]), str(g.dtypes[out]))
    return split_k(b, m, n, k, device, lhs_bits=_side_bits(g, lhs), rhs_bits=_side_bits(g, rhs),
                   acc_bits=acc, out_bits=_BITS.get(str(g.dtypes[out]), 32))


def padded_k(k: int, split: int, lhs_bits: int, rhs_bits: int) -> int:
    """The contraction a split GEMM is padded to (splitk_rewriter.cc, GetPaddedK): a multiple of
    `split` chunks of 16 bytes of the narrower operand.

    >>> padded_k(1000, 8, 32, 32), padded_k(1000, 4, 32, 32), padded_k(1000, 8, 16, 16), padded_k(1024, 8, 32, 32)
    (1024, 1008, 1024, 1024)
    """
    step = split * 128 // min(128, lhs_bits, rhs_bits)
    return -(-k // step) * step


def pads_contraction(g: Program, op: Any, device: str) -> bool:
    """Whether the split-K rewriter splits the GEMM `op` on `device` and pads its contraction
    (`padded_k` differs from it): each operand is then a `pad` XLA stores (`padded_operand_bytes`)."""
    split = dot_split(g, op, device)
    if split <= 1:
        return False
    lhs, rhs = op.operands[:2]
    k = _dims(g, op)[3]
    return k > 0 and padded_k(k, split, _side_bits(g, lhs), _side_bits(g, rhs)) != k


def padded_operand_bytes(g: Program, op: Any, split: int, group: Sequence[Any] = (),
                         fused: Sequence[bool] | None = None) -> int:
    """The bytes of the zero-padded operand copies a split GEMM reads when its contraction is
    not a multiple of `padded_k`'s step: the rewriter pads both operands (a `pad` each), which
    XLA stores as loop fusions just before the GEMM (`loop_pad_fusion f32[128,1024]` and
    `f32[1000,1024]` for a [128,1000] x [1000,1000] GEMM split 8 ways on H100; 1008 on A100,
    split 4 ways); 0 where no padding is needed. `group`: the dot merger's group holding `op`;
    its shared operand is padded once, with the group's first member.

    Only operands the program does not compute (its arguments, a loop or cond body's
    parameters, or views of them computed inside the GEMM: `fused`) count: those stay live
    beside their padded copy. A computed operand's copy
    takes its place: XLA runs the operand's other readers first, so it dies at the pad
    (gpt2_vocab's 50257-token head: the logits gradient, 206 MB, is padded to 50272 after the
    weight-gradient GEMM read it)."""
    if split <= 1:
        return 0
    lhs, rhs = op.operands[:2]
    _, _, _, k = _dims(g, op)
    target = padded_k(k, split, _side_bits(g, lhs), _side_bits(g, rhs))
    if k <= 0 or target == k:
        return 0
    operands = [lhs, rhs]
    if len(group) > 1 and group[0] is not op:
        shared = lhs if all(other.operands[0] == lhs for other in group) else rhs
        operands.remove(shared)
    return sum(g.nbytes[u] // k * target for u in operands if _from_argument(g, u, fused))


def _from_argument(g: Program, u: int, fused: Sequence[bool] | None) -> bool:
    """Whether `u` is an argument of `g`, or computed inside its reader (`fused`) from one
    through single-operand ops (a transpose, slice or convert of a weight)."""
    while g.producer[u] >= 0:
        op = g.ops[g.producer[u]]
        ins = [w for w in op.operands if isinstance(w, int)]
        if fused is None or not fused[u] or len(ins) != 1:
            return False
        u = ins[0]
    return True


def accumulator_bits(lhs: str, rhs: str, out: str) -> int:
    """The width of XLA's default GEMM accumulator (GetDefaultGemmAlgorithmAccumulatorType):
    s32 for 8-bit integer operands with a 32-bit integer result, f64 for an f64 GEMM, f32 for
    everything else (float8 operands included). The split's partials are in this type.

    >>> accumulator_bits("int8", "int8", "int32"), accumulator_bits("float64", "float64", "float64")
    (32, 64)
    """
    return 64 if lhs == "float64" and out == "float64" else 32


def _reduce_fused(g: Program, v: int, fused: Sequence[bool], outputs: set[int]) -> bool:
    """Whether the split's reduce of `v` fuses into all its consumers (see the module's text): no
    consumer is a GEMM or an op outside loop/reduction fusions, `v` is no program output, and a
    consumer whose own result the model fuses onwards feeds no GEMM (GEMM fusion takes the
    elementwise op into its operand, not the reduce before it)."""
    if v in outputs or not g.users[v]:
        return False
    minor = len(g.shapes[v]) - 1
    for ci in g.users[v]:
        c = g.ops[ci]
        if c.primitive not in ABSORBING and c.primitive != TRITON_ROW_FUSION:
            return False
        # a reduction over leading dimensions only (a column sum) does not take the reduce:
        # XLA stores the reduced result for it (measured: `(x @ w).sum(0)` on H100)
        axes = c.params.get("axes") if c.primitive in GPU_HLO_REDUCE and c.operands[0] == v else None
        if axes is not None and minor not in tuple(axes):
            return False
        for w in c.outputs:
            if w is not None and fused[w] and _feeds_gemm(g, w, fused, FUSED_GEMM_READER_DEPTH):
                return False
    return True


# How many fused elementwise steps `_reduce_fused` follows from a consumer of the split result
# to a GEMM that reads the chain in its prologue: nodrop's relu gradient is
# `select(gt(x @ w, 0), 1, 0)` read by the weight-gradient GEMM, two fused steps from the
# partials: XLA stores the select (`loop_select_fusion`, f32[64,512]) and the partials die there
# (`benchmarks/outside_models/drop_small.py:nodrop`'s dump).
FUSED_GEMM_READER_DEPTH = 4


def _feeds_gemm(g: Program, w: int, fused: Sequence[bool], depth: int) -> bool:
    """Whether fused value `w` is read by a GEMM, directly or through up to `depth` more fused values."""
    for r in g.users[w]:
        op = g.ops[r]
        if op.primitive in DOT_LIKE:
            return True
        if depth > 0 and any(x is not None and fused[x] and _feeds_gemm(g, x, fused, depth - 1) for x in op.outputs):
            return True
    return False


def _stored_readers(g: Program, v: int, fused: list[bool]) -> None:
    """Store (in `fused`, in place) each value the model would recompute in several consumers
    downstream of the split partials `v` through fused elementwise ops: priority fusion put the
    split's reduce into that producer, and duplicating a kernel that reads `s` times the result
    into every reader costs more than storing it once (transformer_train's dump: the residual
    add after a split projection, `loop_add_fusion`, is stored; the model recomputed it).
    The walk stops at an update: a dynamic_update_slice reads only its update's few elements
    from the split result, so each reader recomputing it costs little (kv_decode's dump: the
    new key written into the cache slice is computed inside both the attention reduction and
    the stacked cache's concatenate, from the split partials, and stored in neither)."""
    todo = [(ci, v) for ci in g.users[v]]
    seen: set[int] = set()
    while todo:
        ci, read = todo.pop()
        if ci in seen:
            continue
        seen.add(ci)
        op = g.ops[ci]
        if op.primitive == "dynamic_update_slice" and op.operands[0] != read:
            continue
        if _broadcast_downstream(g, op, read):
            continue
        for w in op.outputs:
            if w is None or not fused[w]:
                continue
            if len(g.users[w]) > 1:
                fused[w] = False
            else:
                todo.extend((c, w) for c in g.users[w])


def _broadcast_downstream(g: Program, op: Any, read: int) -> bool:
    """Whether `op` broadcasts the value it reads from the split result (`read`) to more
    elements (a broadcast, or an elementwise op whose operand has size-1 dimensions the result
    does not): the walk of `_stored_readers` stops there. Priority fusion's cost model
    (priority_fusion.cc, GpuPerformanceModel::EstimateRunTimes) does not fuse the split's reduce
    into a fusion that would read each partial once per broadcast element; the reduce stays a
    kernel of its own writing the small result, and the values computed downstream of the
    broadcast keep the fusion they had (a FiLM shift `h * (1 + scale) + shift[:, None, None]`
    from a split Dense is computed inside its readers, not stored)."""
    return ((op.primitive == "broadcast_in_dim" or op.primitive in ELEMENTWISE) and bool(op.outputs)
            and op.outputs[0] is not None and elements(g.shapes[op.outputs[0]]) > elements(g.shapes[read]))


def with_splitk_partials(g: Program, fused: Sequence[bool],
                         device: str) -> tuple[Program, dict[int, int], list[bool]]:
    """`g` as XLA:GPU stores its split GEMMs on `device`: a GEMM whose reduce fuses into its
    consumers has its result replaced by the partials (shape (s, *result), accumulator-typed
    bytes; so no consumer writes over it in place); another split GEMM keeps its result and
    gets the partials as a temporary beside it (op index -> bytes, for the model's scratch).
    Merged GEMMs split as one (each member's partials the merged factor times its result).
    The GEMMs of `g` itself (a loop body is modelled as a program of its own); `g` is copied
    only when something splits. The dot merger's own
    choice reads the unsplit sizes: `predict` groups GEMMs on the program before this.
    Returns the program, the scratch and the fused flags (`_stored_readers`)."""
    outputs = {v for v in g.outvars if not isinstance(v, Const)}
    # the dot merger's groups, in program order (the scheduler's order is not known yet)
    group_of = {oi: [g.ops[m] for m in grp] for grp in merged_dots(g, range(len(g.ops))) for oi in grp}
    shapes, nbytes = None, None
    scratch: dict[int, int] = {}
    fused = list(fused)
    for op in g.ops:
        if op.primitive != "dot_general" or not op.outputs or op.outputs[0] is None:
            continue
        v = op.outputs[0]
        split = dot_split(g, op, device, group_of.get(op.index, ()))
        if split <= 1 or fused[v]:
            continue
        lhs, rhs = op.operands[:2]
        acc_bytes = accumulator_bits(str(g.dtypes[lhs]), str(g.dtypes[rhs]), str(g.dtypes[v])) // 8
        partials = split * _prod(g.shapes[v]) * acc_bytes
        pads = padded_operand_bytes(g, op, split, group_of.get(op.index, ()), fused)
        if pads:
            scratch[op.index] = scratch.get(op.index, 0) + pads
        if _reduce_fused(g, v, fused, outputs):
            if shapes is None:
                shapes, nbytes = list(g.shapes), list(g.nbytes)
            shapes[v] = (split,) + tuple(g.shapes[v])
            nbytes[v] = partials
            _stored_readers(g, v, fused)
        else:
            scratch[op.index] = scratch.get(op.index, 0) + partials
    if shapes is None:
        return g, scratch, fused
    # a new op list: the program's side tables (`program.side_table`, by op list) hold sizes
    return replace(g, ops=list(g.ops), shapes=shapes, nbytes=nbytes), scratch, fused
