"""The plan checker: proves a `Plan` is safe to run, from the plan's own data only.

It re-derives everything from the schedule and the buffers rather than trusting the planner's
intermediate tables: no two buffers live at the same time overlap in address; every value a step
reads (directly, or through a fused operand it recomputes) is live and intact at that step, that
is, no other value was written into its buffer between its definition and that read; outputs
survive to the end; offsets and sizes are 256-aligned; the arena covers every buffer; the
schedule is topological; loop scratch exists; the peak and lower bound add up.

    >>> import jax.numpy as jnp, jaxmem
    >>> plan = jaxmem.plan(lambda x: jnp.sin(x) * 2, jnp.ones(4))
    >>> problems = check_plan(plan)
    >>> problems == []      # valid
    True
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

from jaxmem.compiler.jaxpr_adapter import eqn_params
from jaxmem.compiler.plan_types import Plan
from jaxmem.compiler.rules import DOT_LIKE, is_view
from jaxmem.compiler.stages import live_profile

ALIGNMENT = 256
MAX_PROBLEMS = 50


def check_plan(plan: Plan) -> list[str]:
    """Every way the plan is unsafe, one line each; an empty list means valid.

    **Arguments:** `plan`, as `plan_jaxpr` returns it.

    **Returns:** a list of problems (at most 50 are listed).
    """
    problems: list[str] = []

    def bad(msg: str) -> None:
        if len(problems) < MAX_PROBLEMS:
            problems.append(msg)

    n = len(plan.schedule)
    _check_buffers(plan, n, bad)
    _check_overlap(plan, bad)
    _check_step_positions(plan, bad)
    def_pos = _check_values(plan, n, bad)
    _check_buffer_lists(plan, bad)
    _check_arguments(plan, bad)
    # Per step, the values it reads (`Step.inputs` builds a list per call: asked once here).
    reads = [step.inputs for step in plan.schedule]
    # Values computed inside their readers: no buffer, made by a step, and not a result written
    # into memory outside the plan (a loop body's, in the loop's buffers).
    outside = set(plan.external_outputs)
    fused = {vid for vid, info in plan.values.items()
             if info.buffer is None and info.producer is not None and vid not in outside}
    writers = _writers(plan, def_pos, reads)
    _check_steps(plan, def_pos, reads, fused, writers, bad)
    _check_outputs(plan, n, def_pos, writers, outside, bad)
    _check_totals(plan, n, bad)
    return problems


def _check_step_positions(plan: Plan, bad) -> None:
    for i, step in enumerate(plan.schedule):
        if step.index != i:
            bad(f"step at position {i} says index {step.index}")


def _check_values(plan: Plan, n: int, bad) -> dict[int, int]:
    """Where and how each value is defined: its producer outputs it, its buffer lists it, holds
    its bytes and is live where it is made. Returns each value's defining position (-1: entry)."""
    values, schedule, buffers = plan.values, plan.schedule, plan.buffers
    def_pos: dict[int, int] = {}
    members: dict[int, set[int]] = {}   # buffer id -> its listed values, built when first asked
    for vid, info in values.items():
        if info.producer is None:
            def_pos[vid] = -1
        else:
            def_pos[vid] = info.producer
            if not 0 <= info.producer < n:
                bad(f"value {vid}: producer step {info.producer} outside the schedule")
            elif vid not in schedule[info.producer].outputs:
                bad(f"value {vid}: step {info.producer} does not output it")
        if info.buffer is not None:
            if not 0 <= info.buffer < len(buffers):
                bad(f"value {vid}: no buffer {info.buffer}")
                continue
            buf = buffers[info.buffer]
            listed = members.get(info.buffer)
            if listed is None:
                listed = members[info.buffer] = set(buf.values)
            if vid not in listed:
                bad(f"value {vid}: buffer {buf.id} does not list it")
            if info.nbytes > buf.size and buf.kind != "external":
                bad(f"value {vid}: {info.nbytes} bytes do not fit buffer {buf.id} of {buf.size}")
            if not buf.start <= def_pos[vid] <= buf.end:
                bad(f"value {vid}: defined at {def_pos[vid]} outside buffer {buf.id} [{buf.start}, {buf.end}]")
    return def_pos


def _check_buffer_lists(plan: Plan, bad) -> None:
    for buf in plan.buffers:
        for vid in buf.values:
            info = plan.values.get(vid)
            if info is None or info.buffer != buf.id:
                bad(f"buffer {buf.id} lists value {vid} that is not stored there")


def _check_arguments(plan: Plan, bad) -> None:
    """Arguments have no producer; exactly the donated ones have a buffer, live from entry."""
    donated = set(plan.donated)
    for k, vid in enumerate(plan.invars):
        info = plan.values[vid]
        if info.producer is not None:
            bad(f"argument {k} has a producer")
        if (k in donated) != (info.buffer is not None):
            bad(f"argument {k}: donated={k in donated} but buffer={info.buffer}")
        if info.buffer is not None and plan.buffers[info.buffer].start != -1:
            bad(f"donated argument {k}: buffer does not start on entry")


def _check_steps(plan: Plan, def_pos: dict[int, int], reads: list[list[int]], fused: set[int],
                 writers: dict[int, list[int]], bad) -> None:
    """Per step: its fused flag matches its outputs, it reads only earlier values, its loop
    scratch exists, and every value it reads from memory is intact there."""
    schedule = plan.schedule
    fused_inputs: dict[int, list[int]] = {}
    gemm_inputs: dict[int, list[int]] = {}
    fused_gemms = any(s.fused and s.primitive in DOT_LIKE for s in schedule)
    scratch_at: dict[int, list] = {}   # step -> the scratch buffers starting there
    for b in plan.buffers:
        if b.kind == "scratch":
            scratch_at.setdefault(b.start, []).append(b)
    for i, step in enumerate(schedule):
        all_fused = _check_step_fusion(step, i, fused, bad)
        ins = reads[i]
        _check_read_order(plan, step, i, ins, def_pos, bad)
        if step.scratch_bytes > 0 and not any(
            b.start <= i <= b.end and b.size >= step.scratch_bytes for b in scratch_at.get(i, ())
        ):
            bad(f"step {i} ({step.primitive}): no scratch buffer of {step.scratch_bytes} bytes")
        if all_fused:
            continue
        _check_stored_reads(plan, step, i, ins, def_pos, reads, fused, fused_inputs, writers, bad)
        if fused_gemms:
            _check_fused_gemms(plan, step, i, fused_inputs, gemm_inputs, bad, fused, reads)


def _check_step_fusion(step, i: int, fused: set[int], bad) -> bool:
    """Whether every output of the step is computed inside its readers; reports a step whose
    `fused` flag says otherwise, or whose outputs are partly stored and partly fused."""
    made = unstored = 0   # outputs, and those with no buffer
    for v in step.outputs:
        if v is not None:
            made += 1
            if v in fused:
                unstored += 1
    all_fused = made > 0 and unstored == made
    if step.fused != all_fused:
        bad(f"step {i} ({step.primitive}): fused={step.fused} but outputs fused={all_fused}")
    if not all_fused and unstored:
        bad(f"step {i} ({step.primitive}): some outputs stored and some fused")
    return all_fused


def _check_read_order(plan: Plan, step, i: int, ins: list[int], def_pos: dict[int, int], bad) -> None:
    for v in ins:
        if v not in plan.values:
            bad(f"step {i} ({step.primitive}) reads unknown value {v}")
        elif def_pos[v] >= i:
            bad(f"step {i} ({step.primitive}) reads value {v} defined later, at {def_pos[v]}")


def _check_stored_reads(plan: Plan, step, i: int, ins: list[int], def_pos: dict[int, int],
                        reads: list[list[int]], fused: set[int], fused_inputs: dict[int, list[int]],
                        writers: dict[int, list[int]], bad) -> None:
    """Every value step `i` reads from memory (through fused operands too) is intact there."""
    values, buffers = plan.values, plan.buffers
    for u in ins:
        if u in fused:
            stored = _stored_reads(plan, ins, fused_inputs, fused, reads)
            break
    else:  # nothing computed inside: the operands themselves (`_stored_reads`' plain case)
        stored = [u for u in dict.fromkeys(ins) if u in values]
    for v in stored:
        # `_check_read`'s passing case, inline (it runs per read); it reports the others
        info = values[v]
        if info.buffer is None:
            continue
        buf = buffers[info.buffer]
        if buf.start <= i <= buf.end:
            positions = writers.get(buf.id)
            if positions is None:
                continue
            k = bisect.bisect_right(positions, def_pos[v])
            if k >= len(positions) or positions[k] >= i:
                continue
        _check_read(plan, v, i, def_pos, writers, bad, f"step {i} ({step.primitive})")


def _check_outputs(plan: Plan, n: int, def_pos: dict[int, int], writers: dict[int, list[int]],
                   outside: set[int], bad) -> None:
    """Every output is stored, in a buffer that lasts to the exit, and intact there."""
    for k, v in enumerate(plan.outvars):
        if v is None:
            continue
        info = plan.values[v]
        if info.buffer is None:
            if info.producer is not None and v not in outside:
                bad(f"output {k} (value {v}) is fused: it would never be stored")
            continue
        buf = plan.buffers[info.buffer]
        if buf.end != n:
            bad(f"output {k} (value {v}): buffer {buf.id} ends at {buf.end}, before the exit")
        _check_read(plan, v, n, def_pos, writers, bad, f"output {k}")


def _check_totals(plan: Plan, n: int, bad) -> None:
    """The peak is the non-donated arguments plus the arena; the lower bound, the arguments plus
    the most bytes live at once, and no higher than the peak."""
    external = sum(plan.values[v].nbytes for v in dict.fromkeys(plan.invars) if plan.values[v].buffer is None)
    if plan.peak_bytes != external + plan.arena_bytes:
        bad(f"peak {plan.peak_bytes} != non-donated arguments {external} + arena {plan.arena_bytes}")
    live = _max_live(plan, n)
    if plan.lower_bound_bytes != external + live:
        bad(f"lower bound {plan.lower_bound_bytes} != arguments {external} + max live {live}")
    if plan.lower_bound_bytes > plan.peak_bytes:
        bad(f"lower bound {plan.lower_bound_bytes} above the peak {plan.peak_bytes}")


def _check_buffers(plan: Plan, n: int, bad) -> None:
    for k, buf in enumerate(plan.buffers):
        if buf.id != k:
            bad(f"buffer at position {k} has id {buf.id}")
        if buf.offset % ALIGNMENT or buf.size % ALIGNMENT:
            bad(f"buffer {buf.id}: offset {buf.offset} / size {buf.size} not {ALIGNMENT}-aligned")
        if buf.offset < 0 or buf.offset + buf.size > plan.arena_bytes:
            bad(f"buffer {buf.id} [{buf.offset}, {buf.offset + buf.size}) outside the arena of {plan.arena_bytes}")
        if not -1 <= buf.start <= buf.end <= n:
            bad(f"buffer {buf.id}: bad live range [{buf.start}, {buf.end}]")


def _check_overlap(plan: Plan, bad) -> None:
    bufs = [b for b in plan.buffers if b.size > 0]
    if len(bufs) < 2 or not _any_overlap(bufs):
        return
    # some pair clashes: list them pair by pair (at most 3 per buffer), in buffer order
    start = np.array([b.start for b in bufs], np.int64)
    end = np.array([b.end for b in bufs], np.int64)
    lo = np.array([b.offset for b in bufs], np.int64)
    hi = lo + np.array([b.size for b in bufs], np.int64)
    for i in range(len(bufs) - 1):
        clash = (start[i + 1:] <= end[i]) & (end[i + 1:] >= start[i]) & (lo[i + 1:] < hi[i]) & (hi[i + 1:] > lo[i])
        for j in np.nonzero(clash)[0][:3]:
            a, b = bufs[i], bufs[i + 1 + int(j)]
            bad(f"buffers {a.id} and {b.id} are live together and overlap in address")


def _any_overlap(bufs: list) -> bool:
    """Whether two buffers (each of some bytes) are live together and overlap in address.

    A sweep over start steps keeps the buffers live so far sorted by offset; while they are
    disjoint, a new one overlaps one of them exactly when it overlaps its neighbour on either
    side, so each buffer costs a binary search (the pairwise test is quadratic)."""
    live_lo: list[int] = []     # offsets of the live buffers, sorted
    live_hi: list[int] = []     # their ends, in the same order
    ending: list[tuple[int, int]] = []   # heap of (last live step, offset)
    for b in sorted(bufs, key=lambda b: b.start):
        while ending and ending[0][0] < b.start:
            _, lo = heapq.heappop(ending)
            k = bisect.bisect_left(live_lo, lo)
            del live_lo[k], live_hi[k]
        lo, hi = b.offset, b.offset + b.size
        k = bisect.bisect_left(live_lo, lo)
        if k < len(live_lo) and live_lo[k] < hi:
            return True
        if k > 0 and live_hi[k - 1] > lo:
            return True
        live_lo.insert(k, lo)
        live_hi.insert(k, hi)
        heapq.heappush(ending, (b.end, lo))
    return False


def _writers(plan: Plan, def_pos: dict[int, int], reads: list[list[int]]) -> dict[int, list[int]]:
    """Per buffer, the sorted positions at which a value is written into it (views write nothing)."""
    out: dict[int, list[int]] = {}
    values, schedule = plan.values, plan.schedule
    for vid, info in values.items():
        if info.buffer is None or info.producer is None:
            continue
        step = schedule[info.producer]
        ins = reads[info.producer]
        src = ins[0] if ins else None
        in_dtype = values[src].dtype if src is not None and src in values else None
        if is_view(step.primitive, eqn_params(step.eqn) if step.eqn is not None else None, in_dtype):
            if src is not None and values[src].buffer == info.buffer:
                continue
        out.setdefault(info.buffer, []).append(def_pos[vid])
    for positions in out.values():
        positions.sort()
    return out


def _stored_reads(plan: Plan, inputs: list[int], memo: dict[int, list[int]], fused: set[int],
                  reads: list[list[int]]) -> list[int]:
    """Values really read from memory: fused operands are replaced by what they are computed
    from, through chains of fused values (iteratively: chains can be thousands long).
    `fused`: the values with no buffer that a step makes; `reads`: each step's inputs."""
    values = plan.values
    for v in inputs:
        if v not in fused or v in memo:
            continue
        stack = [v]
        while stack:
            w = stack[-1]
            if w in memo:
                stack.pop()
                continue
            ins = reads[values[w].producer]
            pending = [u for u in ins if u in fused and u not in memo]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            found: dict[int, None] = {}
            for u in ins:
                if u in fused:
                    for x in memo[u]:
                        found[x] = None
                elif u in values:
                    found[u] = None
            memo[w] = list(found)
    result: dict[int, None] = {}
    for v in inputs:
        if v not in values:
            continue
        if v in fused:
            for x in memo[v]:
                result[x] = None
        else:
            result[v] = None
    return list(result)


def _check_fused_gemms(plan: Plan, step, i: int, memo: dict[int, list[int]], gemm_memo: dict[int, list[int]],
                       bad, fused: set[int], reads: list[list[int]]) -> None:
    """A GEMM computed inside a step (its epilogue) reads its operands while the step writes its
    results: none of those operands may lie in a buffer the step writes."""
    written = {plan.values[v].buffer for v in step.outputs if v is not None and plan.values[v].buffer is not None}
    if not written:
        return
    for v in reads[i]:
        for u in _gemm_operands(plan, v, memo, gemm_memo, fused, reads):
            if plan.values[u].buffer in written:
                bad(f"step {i} ({step.primitive}) writes buffer {plan.values[u].buffer} that a GEMM "
                    f"computed inside it reads (value {u})")


def _gemm_operands(plan: Plan, v: int, memo: dict[int, list[int]], gemm_memo: dict[int, list[int]],
                   fused: set[int], reads: list[list[int]]) -> list[int]:
    """The stored values GEMMs read inside the fused chain that computes `v` (none when `v` is
    stored); iterative, memoized per fused value."""
    if v not in fused:
        return []
    stack = [v]
    while stack:
        w = stack[-1]
        if w in gemm_memo:
            stack.pop()
            continue
        at = plan.values[w].producer
        inner, inner_ins = plan.schedule[at], reads[at]
        pending = [u for u in inner_ins if u in fused and u not in gemm_memo]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        found: dict[int, None] = {}
        if inner.primitive in DOT_LIKE:
            found.update(dict.fromkeys(_stored_reads(plan, inner_ins, memo, fused, reads)))
        for u in inner_ins:
            if u in fused:
                found.update(dict.fromkeys(gemm_memo[u]))
        gemm_memo[w] = list(found)
    return gemm_memo[v]


def _check_read(plan: Plan, v: int, i: int, def_pos, writers, bad, who: str) -> None:
    info = plan.values[v]
    if info.buffer is None:
        return  # a non-donated argument: caller's memory, always live and never written
    buf = plan.buffers[info.buffer]
    if not buf.start <= i <= buf.end:
        bad(f"{who} reads value {v} but buffer {buf.id} is live only [{buf.start}, {buf.end}]")
        return
    positions = writers.get(buf.id, [])
    d = def_pos[v]
    k = bisect.bisect_right(positions, d)
    if k < len(positions) and positions[k] < i:
        bad(f"{who} reads value {v}, overwritten at step {positions[k]} in buffer {buf.id}")


def _max_live(plan: Plan, n: int) -> int:
    profile = live_profile(((b.start, b.end, b.size) for b in plan.buffers), n)
    return int(profile.max()) if plan.buffers else 0
