"""Temporaries the XLA:GPU model adds around single ops (a cuBLAS workspace, a float8
fallback's copies) and around loops (their bodies, modelled as
programs of their own), as per-op scratch for the heap pass."""

from __future__ import annotations

from typing import Any, Callable

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler import planner
from jaxmem.compiler.program import Program, side_table
from jaxmem.compiler.stages import Roles, Span, align
from jaxmem.xla.gpu.model.performance import device_numbers
from jaxmem.xla.gpu.model.ops import dot_kind, elements

# cuBLASLt's workspace beside the float8 fallback's GEMM (its dump: the custom call's second
# result, s8[4194304], on A100).
FLOAT8_FALLBACK_WORKSPACE = 4 * 2 ** 20
FLOAT8_NATIVE_SM = 89   # float8 GEMMs need compute capability 8.9 (Ada) or later


def op_scratch(g: Program, op: Any, workspace: int) -> int:
    """Temporaries XLA:GPU adds around one op, live while it runs: a cuBLAS GEMM's workspace.
    (A max-pool gradient's reduce-window outputs are buffers of their own:
    `heap.pool_index_spans`.)"""
    if op.primitive == "dot_general" and dot_kind(op, g) == "gemm":
        return workspace
    return 0


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
    return FLOAT8_FALLBACK_WORKSPACE + sum(2 * elements(g.shapes[u]) for u in op.operands[:2])


BodyHeap = Callable[[Program, Roles], list[Span]]


def loop_scratch(g: Program, body_heap: BodyHeap, place: Callable[[list], int],
                 nested_fusion: Callable) -> tuple[dict[int, int], dict[int, int]]:
    """Per loop/cond op, its body's temporaries as XLA:GPU compiles the body: (the scratch
    bytes besides the largest, the largest). Each body is modelled as a program of its own
    (`body_heap`: its fusion, its split GEMMs' partials, its schedule and heap; `place` sizes
    that heap), with the roles the planner gives a body (results written into the loop's
    buffers, a new carry in its old one's). XLA's split-K rewriter visits every non-fusion
    computation, while and scan bodies and cond branches included (splitk_rewriter.cc:
    MakeNonfusionComputations), which the planner's own plan of a body does not know
    (`benchmarks/outside_models/while_data.py`: the body's GEMM holds f32[8,64,512] on H100).
    The largest body value is apart because buffer assignment places each value on its own:
    it may take an output allocation free at the time (`heap.with_pieces`). Opaque
    ops with jaxprs of their own keep the planner's scratch, planned with `nested_fusion` as
    the fusion base."""
    cache: dict[tuple, tuple[int, int]] = {}

    def body(closed: Any, pairs: tuple[int | None, ...] | None) -> tuple[int, int]:
        key = (id(closed), pairs)
        if key not in cache:
            b = planner.inlined(ja.as_closed(closed))
            outputs = [True] * len(pairs) if pairs is not None else ()
            heap = body_heap(b, planner.value_roles(b, [False] * len(b.invars), outputs, pairs or ()))
            total = int(place(heap) or 0)
            largest = min(total, max((size for _, _, size in heap), default=0))
            cache[key] = (total - largest, largest)
        return cache[key]

    scratch: dict[int, int] = {}
    pieces: dict[int, int] = {}
    nested = side_table(g, "nested jaxprs", planner.opaque_nested_jaxprs)
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
                                                       base_fusion=nested_fusion).arena_bytes
                                    for sub in nested[op.index])
            continue
        else:
            continue
        rest, largest = max(parts, key=sum)
        scratch[op.index] = rest
        if largest:
            pieces[op.index] = largest
    return scratch, pieces
