"""The XLA:GPU model's heap pass: from one schedule's liveness to XLA's temp block.

XLA:GPU's buffer assignment (xla/service/buffer_assignment.cc) gives arguments and outputs
their own allocations and packs every temporary into one block, placed by its heap simulator
(xla/service/heap_simulator/heap_simulator.cc; `heap_simulator.xla_heap_size`). jaxmem's liveness
(`compiler.liveness.assign_buffers`) gives the buffers; then, in order:

- `INTERVAL_ADJUSTMENTS`, `(case, intervals) -> intervals`: buffers XLA holds otherwise than
  jaxmem's liveness (a merged dot's results as one buffer, a convolution's result never
  overwritten in place, an output allocation holding a scan's stacked output from the start,
  a loop body's largest value);
- `heap_after_reuse`: temporaries that take a free output allocation leave the heap;
- `SPAN_ADJUSTMENTS`, `(case) -> spans`: buffers XLA adds that the program does not show
  (shared zeros, a max-pool gradient's index arrays, scan outputs held from the start,
  donated-output prefixes, concatenated operands of a merged dot, the gathers a cloned
  concatenate's GEMMs read).

`best_heap` scores every schedule of the scheduling pass by its heap's lower bound and keeps
the least, as XLA's memory scheduler keeps its best order.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.liveness import Interval, assign_buffers, op_facts
from jaxmem.compiler.plan_types import Const
from jaxmem.compiler.program import Program
from jaxmem.compiler.rules import GPU_RELU_ZERO_READERS, storage_rule
from jaxmem.compiler.stages import Analysis, Roles, Span, align, live_profile
from jaxmem.xla.gpu.model.heap_simulator import xla_heap_size
from jaxmem.xla.gpu.model.conv import early_copies, shared_copy_spans
from jaxmem.xla.gpu.model.fusion_concat import sibling_gather_spans
from jaxmem.xla.gpu.model.ops import elements, merged_dots, no_inplace
from jaxmem.xla.gpu.model.schedule import merged_order, xla_orders

# triton_fusion_analysis.h: kMaxParameterPerDotOperand, the parameters a GEMM fusion reads per operand.
GEMM_PARAMETERS_PER_OPERAND = 4


@dataclass
class HeapCase:
    """One schedule as the heap adjustments read it: the program, the (merged) order, its
    liveness, the roles, the dot merger's groups, the interval ids of outputs in donated
    arguments' allocations (`aliased`) with the argument each takes (`donated_sources`),
    per loop op its body's largest value (`pieces`), the scheduler whose order it is, the
    fused flags, the device ("" where not known) and where each convolution whose adds are
    fused into its cuDNN call runs (`calls`: `conv.conv_calls`, found before
    `no_inplace` renames the calls' ops)."""

    g: Program
    order: list[int]
    live: Any
    roles: Roles
    groups: list[list[int]]
    aliased: set[int]
    donated_sources: dict[int, int]
    pieces: dict[int, int]
    scheduler: str = ""
    fused: Sequence[bool] = ()
    device: str = ""
    analysis: Analysis | None = None
    copies: dict[int, int] | None = None
    calls: dict[int, int] | None = None


Spans = list[Span]


def with_pieces(case: HeapCase, intervals: list[Any]) -> list[Any]:
    """`intervals` and, per loop op in `pieces`, its body's largest value as a scratch buffer
    of its own while the loop runs, so that buffer assignment may give it an output allocation
    free at the time as it does (while_cond's dump: the while body's f32[4,1024,256] partials
    sit in the allocation of the cond's result, written later). A cond branch's value may
    also take the allocation of the cond's own result when that is a program output, large
    enough and not aliased: the branch writes its result last (while_cond's branch partials,
    f32[4,1024,256], there too)."""
    g, live, pieces, aliased = case.g, case.live, case.pieces, case.aliased
    if not pieces:
        return intervals
    pos = {oi: p for p, oi in enumerate(case.order)}
    extra = []
    for oi, size in sorted(pieces.items()):
        op = g.ops[oi]
        if oi not in pos:
            continue
        if op.primitive == "cond":
            # the result's own allocation only where the result is the program's output (live
            # out: created before any smaller temp); one that a later op updates in place is
            # a temp of the branch's body in XLA (cond_switch_topk's weight gradient)
            results = {v for v in op.outputs if v is not None} & set(v for v in g.outvars if not isinstance(v, Const))
            own = {live.group[v] for v in results if live.group[v] >= 0} - set(aliased)
            if any(iv.id in own and iv.kind == "output" and iv.size >= size for iv in intervals):
                continue
        extra.append(Interval(-10_000_000 - oi, [], pos[oi], pos[oi], align(size), "scratch", oi))
    return list(intervals) + extra


def row_loops_in_place(g: Program, order: Sequence[int], fused: Sequence[bool],
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
    return no_inplace(g, blocked) if blocked else g


def _is_zero(u: Any) -> bool:
    """A literal (scalar) zero operand."""
    try:
        return isinstance(u, Const) and getattr(u.value, "shape", ()) == () and float(u.value) == 0.0
    except (TypeError, ValueError):
        return False


def _shared_zeros(g: Program, pos: dict[int, int], op: Any) -> tuple[bool, int]:
    """(whether the zeros of the max-pool gradient `op` are shared with other zeros of its
    shape, the position of their last reader): a zero broadcast of the pooled operand's shape
    and dtype, or a relu reading a literal zero of that shape (`shared_zero_spans`)."""
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
        elif zeros and other.primitive in GPU_RELU_ZERO_READERS:
            shared = True
            last = max(last, pos[other.index])
    return shared, last


def shared_zero_spans(case: HeapCase) -> list[Span]:
    """Buffers XLA:GPU adds when a max-pool gradient's zeros are also a relu's zeros.

    XLA expands a max-pool gradient (select_and_scatter_add) into a scatter that writes, in
    place, into a zero broadcast of the pooled operand's shape. Where the program reads zeros
    of that shape elsewhere (the relu `max(x, 0)` before the pool, the relu gradient's
    `select(x > 0, g, 0)` after it), XLA's CSE makes them one broadcast; the scatter's in-place
    operand then needs a copy of it, and XLA emits both in one multi-output loop fusion with no
    operands, which its scheduler runs first (the dump of
    `tests/gpu/fusion_programs.py:relu_max_pool_gradient`). So both are live from the start of
    the program: the copy until the scatter takes it over, the zeros until their last reader.
    A lone max-pool gradient (no other zeros of its shape): `early_scatter_zero_spans`. None
    where the gradient is added to another (a U-Net's skip connection): the algebraic
    simplifier makes that sum the scatter's operand (algebraic_simplifier.cc, HandleAdd), so no
    zeros are written at all (`tests/gpu/fusion_programs.py:relu_max_pool_gradient_added`: the
    scatter reads a `wrapped_slice`, the one `loop_broadcast_fusion` is a bias's f32[8]).

    **Returns:** (start, end, size) spans over positions of `order`.
    """
    g, order = case.g, case.order
    pos = {oi: p for p, oi in enumerate(order)}
    spans = []
    for op in g.ops:
        if op.primitive != "select_and_scatter_add" or len(op.inputs) < 2 or op.index not in pos:
            continue
        if _added_to_another(g, op):
            continue
        shared, last = _shared_zeros(g, pos, op)
        if shared:
            size = align(g.nbytes[op.inputs[-1]])
            spans.append((0, pos[op.index] - 1, size))   # the copy, the scatter's in-place buffer
            spans.append((0, last, size))                # the shared zeros
    return spans


def stacked_outputs(case: HeapCase) -> list[tuple[int, int]]:
    """(position of the scan, stacked output) for each scan's stacked output that is a
    temporary of the program (not itself an output, read by something), in the order."""
    g, roles = case.g, case.roles
    found = []
    for p, oi in enumerate(case.order):
        op = g.ops[oi]
        if op.primitive != "scan" or p == 0:
            continue
        _, num_carry = ja.scan_counts(op.eqn)
        found.extend((p, y) for y in op.outputs[num_carry:]
                     if y is not None and not roles.outputs[y] and not roles.external[y] and g.users[y])
    return found


def _in_output_allocation(case: HeapCase, y: int) -> bool:
    """Whether `y`'s buffer group is an output's own allocation (an output written over it in
    place), not a donated argument's."""
    gid = case.live.group[y]
    return gid >= 0 and gid not in case.aliased and case.live.intervals[gid].kind == "output"


def stacked_outputs_from_start(case: HeapCase, intervals: list[Any]) -> list[Any]:
    """The intervals with each output allocation that a scan's stacked output shares held from
    the program's start.

    A scan's stacked output is a while loop's state, zero-initialised by a broadcast with no
    operands that XLA's scheduler runs first; the broadcast, the loop's state, the body's
    `dynamic_update_slice` and the loop's result are one buffer (copy_insertion.cc adds no
    copy: the body's update is in place; hlo_alias_analysis.cc makes a while's init, body
    parameter, body root and result one HloBuffer, the dump's `(phi)` values). When an output
    is then written over the stacked output (Adam's update of a scanned layer's weight
    gradient: the output is defined where the stacked output's last reader runs), buffer
    assignment gives that buffer the output's allocation (buffer_assignment.cc,
    `BufferAssigner::MaybeAssignBuffer`: an allocation whose buffers' live ranges do not
    overlap), which then holds the stacked output from the broadcast on: the temporaries
    before the scan cannot take it (`heap_after_reuse`), and nothing of it is in the temp
    block (`scan_output_spans` leaves it out). The dump of
    `tests/gpu/fusion_programs.py:scan_output_into_output`: `loop_broadcast_fusion`,
    `while.5{1}` and the output `loop_subtract_fusion` in the output's allocation.
    """
    starts = {case.live.group[y] for _, y in stacked_outputs(case) if _in_output_allocation(case, y)}
    if not starts:
        return intervals
    return [replace(iv, start=0) if iv.id in starts and iv.kind == "output" else iv for iv in intervals]


def early_scatter_zero_spans(case: HeapCase) -> list[Span]:
    """A lone max-pool gradient's zeros, live from the start of the program in the list
    scheduler's order.

    XLA's SelectAndScatterExpander (xla/service/select_and_scatter_expander.cc) rewrites the
    gradient into a reduce-window and a scatter that adds, in place, into a zero broadcast of
    the pooled operand's shape; that broadcast is a loop fusion with no operands. XLA's list
    scheduler (xla/service/hlo_memory_scheduler.cc, ListScheduler::CreateSchedule) puts every
    instruction with no operands in its ready list at the start and runs the ready one that
    frees the most bytes net of what it defines: a broadcast that defines less than the
    forward pass's convolutions runs before them, and its buffer is held until the scatter
    (the dump of `tests/gpu/fusion_programs.py:max_pool_gradient_not_added`: the zeros'
    `loop_broadcast_fusion` first in the schedule). XLA's DFS order visits the broadcast as
    the scatter's operand, right before it, so only the list order holds it early.

    No zeros are left where the gradient's only reader adds it to another gradient of its
    shape (a skip connection's): the algebraic simplifier's scatter fold
    (xla/service/algebraic_simplifier.cc, HandleAdd: `A + scatter(0, i, u)` is
    `scatter(A, i, u)`) makes that gradient the scatter's operand
    (`tests/gpu/fusion_programs.py:max_pool_gradient_added`, unet's dump: the scatter reads a
    `wrapped_slice`). Zeros shared with a relu are `shared_zero_spans`'.

    **Returns:** (start, end, size) spans over positions of `order`.
    """
    if case.scheduler != "list":
        return []
    g = case.g
    pos = {oi: p for p, oi in enumerate(case.order)}
    spans = []
    for op in g.ops:
        if op.primitive != "select_and_scatter_add" or len(op.inputs) < 2 or op.index not in pos:
            continue
        if _added_to_another(g, op) or _shared_zeros(g, pos, op)[0] or pos[op.index] == 0:
            continue
        spans.append((0, pos[op.index] - 1, align(g.nbytes[op.inputs[-1]])))
    return spans


def pool_index_spans(case: HeapCase) -> list[Span]:
    """A max-pool gradient's reduce-window outputs: its s32 index arrays, live from the
    variadic reduce-window that makes them to the scatter that reads them, and its pooled
    values, dead at once; each a buffer of its own.

    XLA's SelectAndScatterExpander (xla/service/select_and_scatter_expander.cc) computes the
    pool's arg-max with a reduce-window over the operand and one iota per dimension: it
    defines the pooled values and one s32 array of the pooled shape per operand dimension
    (the dump of `tests/gpu/fusion_programs.py:max_pool_gradient`), and reads only values
    the forward pass keeps. XLA's list scheduler (xla/service/hlo_memory_scheduler.cc,
    ListScheduler: the ready instruction with the most bytes freed minus bytes defined runs
    next) runs it at the first step where every other ready instruction defines more than it,
    which in a U-Net's decoder is while the forward pass still runs, not beside the scatter
    (the dump of `tests/gpu/fusion_programs.py:pool_indices_in_decoder`:
    `loop_reduce_window_fusion`'s four s32 outputs live from the forward pass to the
    backward's `input_scatter_fusion`). The model takes the first position after the operand
    is made where the op its order runs there scores below the reduce-window; in the DFS
    order, which visits the reduce-window as the scatter's operand, the scatter's own
    position.

    **Returns:** (start, end, size) spans over positions of `order`.
    """
    g, order = case.g, case.order
    pos = {oi: p for p, oi in enumerate(order)}
    pools = [op for op in g.ops if op.primitive == "select_and_scatter_add" and len(op.inputs) >= 2
             and op.index in pos]
    if not pools:
        return []
    score = _list_scores(case) if case.scheduler == "list" and case.analysis is not None else None
    spans = []
    for op in pools:
        source, operand = op.inputs[0], op.inputs[-1]
        index_bytes = align(4 * elements(g.shapes[source]))
        rank = len(g.shapes[operand])
        end = pos[op.index]
        at = end
        if score is not None:
            defined = rank * index_bytes + align(g.nbytes[source])
            ready = pos.get(g.producer[operand], -1) + 1
            at = next((p for p in range(ready, end) if score[p] < -defined), end)
        spans += [(at, end, index_bytes)] * rank + [(at, at, align(g.nbytes[source]))]
    return spans


def _list_scores(case: HeapCase) -> list[int]:
    """Per position of the order, the list scheduler's score of the op run there: bytes of the
    stored values it reads for the last time minus bytes it stores and its scratch
    (hlo_memory_scheduler.cc, BytesFreedIfScheduled: a convolution's padded operand is the pad
    fusion's buffer, defined by a kernel that runs beside the call: unet's `loop_pad_fusion`,
    which XLA's list scheduler runs after the pool's reduce-window)."""
    g, order, fusion, roles = case.g, case.order, case.analysis.fusion, case.roles
    reads, fused, scratch = fusion.reads, fusion.fused, case.analysis.scratch
    last = {}
    for p, oi in enumerate(order):
        for u in reads[oi]:
            last[u] = p
    scores = []
    for p, oi in enumerate(order):
        freed = sum(align(g.nbytes[u]) for u in reads[oi]
                    if last[u] == p and not fused[u] and not roles.external[u] and not roles.outputs[u])
        stored = sum(align(g.nbytes[v]) for v in g.ops[oi].outputs
                     if v is not None and not fused[v] and not roles.external[v])
        scores.append(freed - stored - scratch.get(oi, 0))
    return scores


def _added_to_another(g: Program, op: Any) -> bool:
    """Whether the scatter's result is read only by an add of another value of its shape and
    dtype, which the algebraic simplifier folds into the scatter's operand."""
    v = op.outputs[0] if op.outputs else None
    if v is None or len(g.users[v]) != 1:
        return False
    add = g.ops[g.users[v][0]]
    if add.primitive not in ("add", "add_any") or add.operands.count(v) != 1:
        return False
    other = [u for u in add.operands if u != v]
    return (len(other) == 1 and isinstance(other[0], int) and g.shapes[other[0]] == g.shapes[v]
            and g.dtypes[other[0]] == g.dtypes[v])


def scan_output_spans(case: HeapCase) -> list[Span]:
    """A scan's stacked outputs are held from the start of the program.

    JAX lowers a scan to a while loop whose state holds each stacked output, initialised with
    zeros that every step writes one slice of. That zero broadcast has no operands, so XLA's
    scheduler emits it first: the stacked buffer is live from the program's start, not from
    the loop (scanned_checkpoint_train's dump: the backward scan's four stacked weight
    gradients, 24 MiB of `loop_broadcast_fusion`, live at the cross-entropy gradient before
    the backward scan runs; `tests/gpu/fusion_programs.py:scan_after_large_temporary`). The
    spans cover the positions before the scan; the value's own interval covers the rest.
    Outputs of the program live in their own allocations and are left out, and so are stacked
    outputs an output is written over in place (`stacked_outputs_from_start` holds the
    output's allocation from the start instead).

    **Returns:** (start, end, size) spans over positions of `order`.
    """
    g = case.g
    return [(0, p - 1, align(g.nbytes[y])) for p, y in stacked_outputs(case) if not _in_output_allocation(case, y)]


def donated_output_prefix_spans(case: HeapCase) -> list[Span]:
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

    Except where the earlier values are the donated argument
    updated in place, one `dynamic_update_slice` or scatter after another, the argument read by
    nothing after the first update: XLA's alias analysis makes the argument, each update and
    the output one buffer (an in-place op's operand 0 and result must share), so all of it is
    the argument's allocation. Copy insertion first copies before each update (the updated
    cache is still read), and the copies are removed once the schedule runs every read of the
    old value before the next update (`dus_donate.py:chain_read`'s dumps: four `copy` before the
    scheduler, none after; no temp the size of the cache).

    The case's `aliased` are the interval ids of outputs in donated arguments' allocations,
    its `donated_sources` per such interval id the donated argument (a value) whose allocation
    it takes.

    **Returns:** (start, end, size) spans over positions of `order`.
    """
    g, live, aliased, sources = case.g, case.live, case.aliased, case.donated_sources
    pos = {oi: p for p, oi in enumerate(case.order)}
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
        if sources and iv.id in sources and _updates_of(g, pos, sources[iv.id], iv.members):
            continue
        spans.append((iv.start, min(written), iv.size))
    return spans


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


def early_copy_spans(case: HeapCase) -> list[Span]:
    """Layout copies XLA:GPU's list scheduler makes long before the cuDNN call that reads them
    (`conv.early_copies`), each live from there to the call, where the call's
    scratch holds it; list orders only, with a device."""
    if not (case.device and case.scheduler == "list" and case.analysis is not None):
        return []
    copies = early_copies(case.g, case.calls or {}, case.fused, case.analysis.fusion.reads, case.device)
    if not copies:
        return []
    g, order = case.g, case.order
    pos = {oi: p for p, oi in enumerate(order)}
    score = _list_scores(case)
    spans = []
    for call, size, leaves in copies:
        if call not in pos:
            continue
        # XLA's list scheduler runs the copy (defining `size`, freeing nothing the call does
        # not free) at the first step where the op run there scores below it
        ready = max((pos.get(g.producer[r], -1) for r in leaves), default=-1) + 1
        end = pos[call]
        at = next((p for p in range(ready, end) if score[p] < -size), end)
        if at < end:
            spans.append((at, end - 1, size))
    return spans


def conv_copy_spans(case: HeapCase) -> list[Span]:
    """The transposed copies several cuDNN calls share, each one buffer from its first reader
    to its last (`conv.shared_copy_spans`; only with a device)."""
    if not case.device:
        return []
    return shared_copy_spans(case.g, case.order, case.device, case.calls)


def concatenated_operand_spans(case: HeapCase) -> list[Span]:
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
    g = case.g
    pos = {oi: p for p, oi in enumerate(case.order)}
    spans = []
    for grp in case.groups:
        if len(grp) <= GEMM_PARAMETERS_PER_OPERAND:
            continue
        first = [g.ops[m].operands for m in grp]
        shared = set(first[0]).intersection(*map(set, first[1:]))
        size = sum(align(g.nbytes[u]) for ops in first for u in ops if isinstance(u, int) and u not in shared)
        at = pos.get(grp[0])
        if size and at is not None:
            spans.append((at, at, size))
    return spans


def cloned_concat_operand_spans(case: HeapCase) -> list[Span]:
    """The gathers XLA stores for the GEMMs a concatenate is cloned into, computed together by
    sibling multi-output fusion (xla/service/gpu/transforms/multi_output_fusion.cc;
    `fusion_concat.sibling_gather_spans`). The model leaves them fused (the GEMM
    reads a concatenate it computes inside), so they are spans the program does not show.

    **Returns:** (start, end, size) spans over positions of `order`."""
    if not case.device or not case.fused:
        return []
    return sibling_gather_spans(case.g, case.order, case.fused, case.device)


def bf16_copy_intervals(case: HeapCase, intervals: list[Any]) -> list[Any]:
    """The intervals with each float32-stored value that GEMMs read too (`case.copies`,
    `fusion.bf16_gemm_copies`) held as XLA holds it: the float32 buffer until its
    last reader other than a GEMM, and its bfloat16 copy (float_normalization.cc's convert
    before the GEMMs) from the first GEMM, or the last float32 reader where that runs first
    (the convert fused beside it), to the last GEMM. In the A100 dump of
    `tests/gpu/fusion_programs.py:bf16_bias_gelu_grad` the weight gradient's split-K partials
    take the float32 gradient's place, dead by then."""
    if not case.copies:
        return intervals
    g, live = case.g, case.live
    pos = {oi: p for p, oi in enumerate(case.order)}
    by_id = {iv.id: k for k, iv in enumerate(intervals)}
    out = list(intervals)
    for v, size in case.copies.items():
        k = by_id.get(live.group[v], -1)
        readers = [c for c in g.users[v] if c in pos]
        gemms = [pos[c] for c in readers if g.ops[c].primitive == "dot_general"]
        wide = [pos[c] for c in readers if g.ops[c].primitive != "dot_general"]
        if k < 0 or not gemms or not wide or out[k].kind != "temp" or list(out[k].members)[-1:] != [v]:
            continue
        iv = out[k]
        out[k] = replace(iv, end=max(iv.start, max(wide)))
        out.append(Interval(-20_000_000 - v, [], min(min(gemms), max(wide)), max(gemms), align(size), "temp"))
    return out


def merge_intervals(case: HeapCase, intervals: list[Any]) -> list[Any]:
    """The liveness intervals with each merged group's results as one buffer: from the merged
    dot to the last read of any of its slices (xla/service/gpu/transforms/dot_merger.cc makes
    them one dot whose result is sliced)."""
    g, live, groups = case.g, case.live, case.groups
    if not groups:
        return intervals
    drop: set[int] = set()
    extra = []
    for grp in groups:
        ids = {live.group[g.ops[m].outputs[0]] for m in grp}
        ids.discard(-1)
        members = [iv for iv in intervals if iv.id in ids and iv.kind == "temp"]
        if len(members) < 2:
            continue
        drop.update(iv.id for iv in members)
        extra.append(Interval(-1 - len(extra), [v for iv in members for v in iv.members],
                              min(iv.start for iv in members), max(iv.end for iv in members),
                              sum(iv.size for iv in members), "temp"))
    return [iv for iv in intervals if iv.id not in drop] + extra


def conv_results_kept(case: HeapCase, intervals: list[Any]) -> list[Any]:
    """The intervals with each convolution's result in a buffer of its own: a value written in
    place over it (a batch norm's input gradient over the conv output it reads last) gets a
    new buffer from its op on.

    XLA:GPU calls cuDNN through a custom call whose result is a tuple (the output and a u8
    scratch); its readers read the output through a get-tuple-element. XLA's heap simulator
    shares an operand's buffer with a user's value only when the operand value's defining
    instruction is an operand of the user (xla/service/heap_simulator/heap_simulator.cc,
    HeapSimulator::RunComputation: `value->instruction()->IsUserOf(operand_value->instruction())`
    before CanShareOperandBufferWithUser), which a get-tuple-element of the conv never is. The
    dump of `tests/gpu/fusion_programs.py:conv_batchnorm_grad`: the batch norm's input
    gradient (`loop_add_fusion`) is at an offset of its own while the two conv results it
    reads last (`cudnn-conv.3{0}`, `cudnn-conv-bw-input.1{0}`) are freed at that very fusion;
    in a U-Net every `input_add_reduce_fusion{0}` (the batch norms' input gradients) is at an
    offset of its own. Views of the conv result (a reshape: an XLA bitcast) stay in the
    conv's buffer."""
    g, live = case.g, case.live
    facts = op_facts(g)
    pos = {oi: p for p, oi in enumerate(case.order)}
    out = []
    for iv in intervals:
        members = iv.members
        first = g.producer[members[0]] if members else -1
        if iv.kind not in ("temp", "output") or first < 0 or g.ops[first].primitive != "conv_general_dilated":
            out.append(iv)
            continue
        k = 1
        while k < len(members) and g.producer[members[k]] >= 0 and facts[g.producer[members[k]]][1]:
            k += 1    # views of the conv's result
        if k == len(members) or g.producer[members[k]] not in pos:
            out.append(iv)
            continue
        split = pos[g.producer[members[k]]]
        own = max(align(g.nbytes[v]) for v in members[:k])
        out.append(Interval(-20_000_000 - iv.id, members[:k], iv.start, split, own, "temp"))
        out.append(replace(iv, members=members[k:], start=split))
    return out


def assign_temps(intervals: Sequence[Any], aliased: set[int] = frozenset()) -> int:
    """Temp bytes after XLA's buffer assignment of these liveness intervals (see
    `heap_after_reuse`; the heap is placed by best fit)."""
    return place(heap_after_reuse(intervals, aliased))


def place(heap: list[Span]) -> int:
    """The temp block's size: the heap placed as XLA's heap simulator places it
    (`heap_simulator.xla_heap_size`), fragmentation included."""
    return xla_heap_size(heap)


def heap_after_reuse(intervals: Sequence[Any], aliased: set[int] = frozenset()) -> list[Span]:
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
    heap: list[Span] = []
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


# Run in this order over the liveness intervals, before output-allocation reuse.
INTERVAL_ADJUSTMENTS: list[Callable[[HeapCase, list[Any]], list[Any]]] = [
    merge_intervals, conv_results_kept, stacked_outputs_from_start, with_pieces, bf16_copy_intervals]
# Spans added to the heap after reuse, in this order.
SPAN_ADJUSTMENTS: list[Callable[[HeapCase], Spans]] = [
    shared_zero_spans,
    early_scatter_zero_spans,
    pool_index_spans,
    conv_copy_spans,
    early_copy_spans,
    concatenated_operand_spans,
    cloned_concat_operand_spans,
    scan_output_spans,
    donated_output_prefix_spans,
]


def case_heap(case: HeapCase) -> Spans:
    """The heap's (start, end, size) spans for one schedule: every interval adjustment, the
    output allocations' reuse, then every span adjustment."""
    intervals = case.live.intervals
    for adjust in INTERVAL_ADJUSTMENTS:
        intervals = adjust(case, intervals)
    heap = heap_after_reuse(intervals, case.aliased)
    for extra in SPAN_ADJUSTMENTS:
        heap = heap + extra(case)
    return heap


def best_heap(g: Program, unsplit: Program, analysis: Analysis, fused: Sequence[bool],
              row_loops: dict[int, list[int]], aliases: dict[int, int], pieces: dict[int, int],
              device: str = "", copies: dict[int, int] | None = None,
              calls: dict[int, int] | None = None) -> tuple[Spans, str]:
    """(the heap's spans, the scheduler kept) for `g` under `analysis`: each order of the
    scheduling pass (`xla_orders`, merged dots run together; the dot merger groups GEMMs by
    their sizes before split-K, read from `unsplit`) is scored by its heap's lower bound and
    the least kept; only the winner is placed (placement is most of the model's time).
    `aliases`: output -> donated argument; `row_loops`: `softmax_outputs`' mixed diamonds;
    `copies`: float32 values' bfloat16 copies for GEMMs (`bf16_copy_intervals`)."""
    aliased_values = {g.outvars[j] for j in aliases}
    scored = []
    for name, order in xla_orders(g, analysis).items():
        groups = merged_dots(unsplit, order)
        order = merged_order(order, groups)
        live = assign_buffers(row_loops_in_place(g, order, fused, row_loops), order, analysis, True)
        aliased = {live.group[v] for v in aliased_values if live.group[v] >= 0}
        sources = {live.group[g.outvars[j]]: g.invars[k] for j, k in aliases.items()
                   if live.group[g.outvars[j]] >= 0}
        heap = case_heap(HeapCase(g, order, live, analysis.roles, groups, aliased, sources, pieces, name,
                                  fused, device, analysis, copies, calls))
        bound = int(live_profile(heap, len(order)).max()) if heap else 0
        scored.append((bound, name, heap))
    bound, best_name, heap = min(scored, key=lambda t: t[0])
    return heap, best_name
