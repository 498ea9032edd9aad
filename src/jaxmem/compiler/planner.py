"""Plan a JAX function's device memory from its jaxpr: schedule, fuse, alias, place, check.

The pipeline, one module per step: the front end (`jaxpr_adapter.inline`: the `program`, calls
inlined) -> `schedule` (several orders) -> `fusion` (what is never stored) -> `liveness` (buffer
groups and intervals, with the storage `rules`) -> `placement` (offsets) -> `checker` (the
verdict). Every candidate
schedule is scored by its live bytes; the best one is placed.

    >>> import jax.numpy as jnp
    >>> p = plan(lambda x, w: jnp.tanh(x @ w).sum(), jnp.ones((64, 64)), jnp.ones((64, 64)))
    >>> p.valid, p.peak_bytes >= p.lower_bound_bytes
    (True, True)
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Sequence


from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.checker import check_plan
from jaxmem.compiler.fusion import choose_fusion, forced_fusion, fusion_of
from jaxmem.compiler.program import DROPPED, Program, drop_dead, forget_side_tables, side_table
from jaxmem.compiler.rules import LOOP_PRIMITIVES, storage_rule
from jaxmem.compiler.liveness import Liveness, assign_buffers
from jaxmem.compiler.placement import Placement, place
from jaxmem.compiler.plan_types import Const, PlannedBuffer, Plan, Step, ValueInfo
from jaxmem.compiler.schedule import dfs_schedule, list_schedule, program_order, sink_schedule, topological_orders
from jaxmem.compiler.stages import Analysis, Roles
from jaxmem.errors import ConfigError, PlanError

LOCAL_SEARCH_ROUNDS = 3     # whole-schedule sink moves tried after the best order is chosen
EXHAUSTIVE_MAX_OPS = 10      # programs this small get every topological order tried ...
EXHAUSTIVE_MAX_ORDERS = 720  # ... unless they have more orders than this

_CATEGORY = {"argument": "parameters", "output": "outputs", "temp": "temporaries", "scratch": "temporaries"}


def plan(
    fn: Callable,
    *args: Any,
    donate_argnums: int | Sequence[int] = (),
    xla: bool = False,
    **kwargs: Any,
) -> Plan:
    """Trace `fn(*args, **kwargs)` and plan its memory; `Plan.xla` stays None.

    >>> import jax, jax.numpy as jnp
    >>> def step(w, x):
    ...     return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> params, batch = jnp.ones((64, 64)), jnp.ones((8, 64))
    >>> p = plan(step, params, batch, donate_argnums=(0,))
    >>> p.peak_bytes, p.lower_bound_bytes, p.xla is None
    (36864, 36864, True)

    **Arguments:** `fn` and its example `args` (pytrees of arrays); `donate_argnums`, positional
    arguments whose buffers outputs may take over; keyword arguments are passed to `fn` (closed
    over). `xla` must be False: the compiler compiles nothing with XLA (XLA sits on a floor
    above it, docs/architecture.md); `jaxmem.plan` (`jaxmem.xla.cpu.plan.plan`) is this plan
    with XLA's `memory_analysis()` in `Plan.xla`. The keyword stays so that it is never passed
    on to `fn`, and calls written for `jaxmem.plan` with `xla=False` mean the same here.

    **Returns:** a checked `Plan` (`plan.valid` is the checker's verdict).
    """
    if xla:
        raise ConfigError("compiler.planner.plan compiles nothing with XLA: jaxmem.plan "
                          "(jaxmem.xla.cpu.plan.plan) adds XLA's figures")
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)
    donate_argnums = tuple(donate_argnums)
    start = time.perf_counter()
    traced = ja.trace(fn, args, kwargs, donate_argnums)
    donated = [k in traced.donated for k in range(len(traced.in_avals))]
    traced_at = time.perf_counter()
    result = plan_jaxpr(traced.closed_jaxpr, donated=donated)
    # JAX's tracing; plan_seconds is ours alone
    return replace(result, trace_seconds=traced_at - start)


def plan_jaxpr(
    closed_jaxpr: Any,
    *,
    donated: Sequence[bool] = (),
    fusion: bool = True,
    inplace: bool = True,
    schedulers: Sequence[str] = ("program", "list", "dfs", "dfs_reverse"),
    check: bool = True,
    external_outputs: Sequence[bool] = (),
    carry_inputs: Sequence[int | None] = (),
    base_fusion: Callable[[Program, Roles, list[bool]], list[bool]] | None = None,
) -> Plan:
    """Plan a ClosedJaxpr (as `jax.make_jaxpr` makes it).

    >>> import jax, jax.numpy as jnp
    >>> f = lambda x, y: jnp.sin(x) + y
    >>> x = y = jnp.ones(1024)
    >>> p = plan_jaxpr(jax.make_jaxpr(f)(x, y), donated=[True, False])
    >>> p.valid, p.peak_bytes, p.arena_bytes   # the output takes over donated x's buffer
    (True, 8192, 4096)

    **Arguments:** `closed_jaxpr`; `donated`, one flag per flat input (missing: not donated);
    `fusion`/`inplace` switch those models off (for comparison); `schedulers`, which orders to
    try; `check`, run the checker (sets `Plan.valid`); `external_outputs`, per output, True when
    it is written straight into memory outside this plan (a loop body's results written into
    the loop's own output buffers), so it costs this plan nothing; `carry_inputs`, per output,
    the input it is the new value of (a loop carry, sharing the loop state's buffer);
    `base_fusion`, the target's fusion rules: `(program, roles, forced) -> fused`, the values
    always fused before the peak-driven choice (GPU targets: `jaxmem.xla.gpu.model.predict.gpu_fusion`;
    None: the forced views only, XLA:CPU's model). Loop and cond bodies are planned with it too.

    **Returns:** the `Plan` for the schedule with the fewest live bytes.
    """
    start = time.perf_counter()
    with gc_paused():
        return _plan_jaxpr(closed_jaxpr, start, donated, fusion, inplace, schedulers, check,
                           external_outputs, carry_inputs, base_fusion)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, restored after.

    Planning (and `xla.gpu.model.predict.predict`) makes many small objects and no cycles: the
    collector would only rescan the (large) jaxpr again and again, a third of the time on big
    programs. Nested uses are fine: only the outermost turns it back on.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# The last programs inlined, by their jaxpr's identity: planning one jaxpr for two targets and
# predicting XLA:GPU's figure for it (`xla.gpu.model.predict.plan_on_gpu`, `predict`) inline it once. A
# few are kept (a program and its loop bodies), so that memory held past planning stays small.
INLINED_KEPT = 4
_inlined: dict[int, tuple[Any, Program]] = {}


def inlined(closed_jaxpr: Any) -> Program:
    """`drop_dead(inline(closed_jaxpr))`, shared by every stage that plans or models the same
    jaxpr object (read-only, as every `Program` is).

    >>> import jax, jax.numpy as jnp
    >>> jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(4))
    >>> inlined(jaxpr) is inlined(jaxpr), [op.primitive for op in inlined(jaxpr).ops]
    (True, ['sin', 'mul'])
    """
    hit = _inlined.get(id(closed_jaxpr))
    if hit is not None and hit[0] is closed_jaxpr:
        _inlined[id(closed_jaxpr)] = _inlined.pop(id(closed_jaxpr))  # most recent last
        return hit[1]
    g = drop_dead(ja.inline(closed_jaxpr))
    # the entry holds the jaxpr itself, so its id cannot be reused while the entry is kept
    _inlined[id(closed_jaxpr)] = (closed_jaxpr, g)
    while len(_inlined) > INLINED_KEPT:
        del _inlined[next(iter(_inlined))]
    return g


def _plan_jaxpr(closed_jaxpr, start, donated, fusion, inplace, schedulers, check, external_outputs,
                carry_inputs, base_fusion=None) -> Plan:
    g = inlined(closed_jaxpr)
    flags = list(donated) + [False] * max(0, len(g.invars) - len(donated))
    if len(flags) > len(g.invars):
        raise PlanError(f"{len(donated)} donation flags for {len(g.invars)} inputs")
    roles = value_roles(g, flags, external_outputs, carry_inputs)
    unknown: set[str] = set()
    scratch = _loop_scratch(g, unknown, base_fusion)
    for op in g.ops:
        if storage_rule(op.primitive) == "unknown":
            unknown.add(op.primitive)

    base = forced_fusion(g, roles)
    if base_fusion is not None:
        base = base_fusion(g, roles, base)

    scored: dict[tuple[tuple[int, ...], bytes], Candidate] = {}

    def evaluate(order: list[int], fused: list[bool] | None = None) -> Candidate:
        """Score `order`: fused for this order unless `fused` is given. Schedulers often agree
        (and a re-fused winner often keeps its fusion): each (order, fusion) is scored once."""
        if fused is None:
            fused = choose_fusion(g, order, roles, base) if fusion else base
        key = (tuple(order), bytes(fused))
        if key not in scored:
            analysis = Analysis(roles, fusion_of(g, fused), scratch)
            scored[key] = Candidate(order, analysis, assign_buffers(g, order, analysis, inplace))
        return scored[key]

    results: dict[str, Candidate] = {"program": evaluate(program_order(g))}
    first = results["program"].analysis
    for name in schedulers:
        if name in results or name not in SCHEDULERS:
            continue
        # Scored with the program order's fusion (valid for any order); the winner is re-fused.
        results[name] = evaluate(SCHEDULERS[name](g, first), first.fusion.fused)
    if len(g.ops) <= EXHAUSTIVE_MAX_OPS:
        # Tiny programs (loop bodies, tests): try every order, so the schedule is provably the
        # best under this fusion.
        orders = topological_orders(g, EXHAUSTIVE_MAX_ORDERS)
        if orders is not None:
            results["exhaustive"] = min((evaluate(o, first.fusion.fused) for o in orders), key=lambda c: c.peak)
    best_name = min(results, key=lambda k: (results[k].peak, k != "program"))
    best = results[best_name]
    # Local search: delay memory-growing ops to their first consumer, while that lowers the peak.
    for _ in range(LOCAL_SEARCH_ROUNDS):
        moved = sink_schedule(g, best.analysis, best.order)
        if moved == best.order:
            break
        trial = evaluate(moved, best.analysis.fusion.fused)
        if trial.peak >= best.peak:
            break
        best = trial
        best_name = best_name if best_name.endswith("+sink") else best_name + "+sink"
    if fusion and best_name != "program":
        refused = evaluate(best.order)
        if refused.peak < best.peak:
            best = refused
    if fusion:  # fusion can cost in-place opportunities; keep it only where it pays
        unfused = evaluate(best.order, base)
        if unfused.peak < best.peak:
            best = unfused
            best_name += "+unfused"
    placement = place([(iv.start, iv.end, iv.size) for iv in best.live.intervals], stop_at=best.peak)
    result = _build_plan(g, best, placement, flags, best_name, results, sorted(unknown))
    for fused in {bytes(c.analysis.fusion.fused) for c in scored.values()}:
        forget_side_tables(g, fused)   # this plan's own fusions: no other plan asks for them
    if check:
        checked = time.perf_counter()
        problems = check_plan(result)
        result = replace(result, valid=not problems, problems=problems, check_seconds=time.perf_counter() - checked)
    return replace(result, plan_seconds=time.perf_counter() - start)  # the checker's proof included


@dataclass
class Candidate:
    """A schedule scored: its order, the analysis it was scored under, and its liveness."""

    order: list[int]
    analysis: Analysis
    live: Liveness

    @property
    def peak(self) -> int:
        return self.live.peak


# Every scheduler: (program, analysis) -> order. Adding one is adding it here.
SCHEDULERS: dict[str, Callable[[Program, Analysis], list[int]]] = {
    "list": list_schedule,
    "list_late": functools.partial(list_schedule, prefer_late=True),
    "dfs": dfs_schedule,
    "dfs_reverse": functools.partial(dfs_schedule, reverse_roots=True),
}


def value_roles(g: Program, flags: list[bool], external_outputs: Sequence[bool],
                carry_inputs: Sequence[int | None]) -> Roles:
    """Each value's role: donated arguments live in the arena, the others outside; a loop body's
    results written straight into the loop's buffers live outside too."""
    nv = g.num_values
    donated = [False] * nv
    external = [False] * nv
    for v, d in zip(g.invars, flags):
        donated[v] = donated[v] or bool(d)
    for v in g.invars:
        external[v] = not donated[v]
    outputs = [False] * nv
    for v in g.outvars:
        if not isinstance(v, Const):
            outputs[v] = True
    carry_of: dict[int, int] = {}
    for k, (v, ext) in enumerate(zip(g.outvars, external_outputs)):
        if ext and not isinstance(v, Const) and g.producer[v] >= 0:
            external[v] = True
            if k < len(carry_inputs) and carry_inputs[k] is not None:
                carry_of[v] = g.invars[carry_inputs[k]]
    for v, old in list(carry_of.items()):
        # a carry updated in place update after update (a KV cache written per layer inside a
        # decode loop): every step lives in the loop state, each over the one before it
        chain = _update_chain(g, v, old, outputs)
        for u in chain:
            external[u] = True
            carry_of[u] = old
            old = u
        carry_of[v] = old
    return Roles(external, outputs, donated, carry_of)


def _update_chain(g: Program, v: int, old: int, outputs: Sequence[bool]) -> list[int]:
    """The values between a loop body's old carry `old` and its new carry `v` when `v` is `old`
    updated in place op after op (each a dynamic_update_slice or scatter whose operand 0 is the
    one before), first to last; [] otherwise. XLA keeps all of them in the loop state's buffer:
    an in-place op's operand 0 and result share one, and its copy insertion adds none where the
    schedule runs each step's other readers before the next update (a donated cache written
    twice per iteration of a `fori_loop`: no temporary the size of the cache in XLA:GPU's
    buffer assignment)."""
    chain: list[int] = []
    w = v
    while True:
        p = g.producer[w]
        if p < 0:
            return []
        op = g.ops[p]
        if storage_rule(op.primitive) != "update" or not op.operands or not isinstance(op.operands[0], int):
            return []
        prev = op.operands[0]
        if prev == old:
            return chain[::-1]
        if outputs[prev]:
            return []
        chain.append(prev)
        w = prev


def _loop_scratch(g: Program, unknown: set[str], base_fusion: Any = None) -> dict[int, int]:
    """Bytes of each loop/cond body's own temporaries, planned recursively (bodies planned once).

    A body's results are written into the loop's own buffers, which the outer plan already
    holds: cond branches write their outputs straight into the cond's outputs, a scan body its
    ys into the stacked outputs, and a loop body its new carries into the loop state, in place
    where the old carry is dead by then (else the new carry needs a temporary of its own, as
    XLA's while loops copy)."""
    cache: dict[tuple, Plan] = {}

    def body_arena(closed: Any, pairs: tuple[int | None, ...] | None) -> int:
        key = (id(closed), pairs)
        sub = cache.get(key)
        if sub is None:
            jaxpr = ja.as_closed(closed)
            if pairs is None:
                sub = plan_jaxpr(jaxpr, check=False, base_fusion=base_fusion)
            else:
                sub = plan_jaxpr(jaxpr, check=False, external_outputs=[True] * len(pairs), carry_inputs=pairs,
                                 base_fusion=base_fusion)
            cache[key] = sub
            unknown.update(sub.unknown_primitives)
        return sub.arena_bytes

    scratch: dict[int, int] = {}
    nested = side_table(g, "nested jaxprs", opaque_nested_jaxprs)
    for op in g.ops:
        bodies = ja.loop_bodies(op.eqn) if op.primitive in ja.LOOP_PRIMITIVES else []
        if op.primitive == "cond":
            scratch[op.index] = max(body_arena(b, (None,) * len(op.outputs)) for b in bodies)
        elif op.primitive == "scan":
            num_consts, num_carry = ja.scan_counts(op.eqn)
            pairs = tuple(num_consts + k if k < num_carry else None for k in range(len(op.outputs)))
            scratch[op.index] = body_arena(bodies[0], pairs)
        elif op.primitive == "while":
            cond_nconsts, body_nconsts = ja.while_counts(op.eqn)
            pairs = tuple(body_nconsts + k for k in range(len(op.outputs)))
            scratch[op.index] = max(body_arena(bodies[0], None), body_arena(bodies[1], pairs))
        elif op.index in nested:
            # Opaque primitives with their own jaxprs (custom_linear_solve, ...) get the largest
            # of them as scratch, conservatively.
            scratch[op.index] = max(body_arena(ja.as_closed(s), None) for s in nested[op.index])
    return scratch


def opaque_nested_jaxprs(g: Program) -> dict[int, list[Any]]:
    """Op index -> the jaxprs in its parameters, for the opaque ops (storage rule unknown or
    fresh, not a loop) that hold some: a side table, so the plans and the prediction of one
    program search the (many) ops' parameters once."""
    out: dict[int, list[Any]] = {}
    for op in g.ops:
        if op.primitive not in LOOP_PRIMITIVES and storage_rule(op.primitive) in ("unknown", "fresh"):
            subs = ja.nested_jaxprs(op.eqn)
            if subs:
                out[op.index] = subs
    return out


def _build_plan(g: Program, best: Candidate, placement: Placement, flags: list[bool], scheduler: str,
                results: dict[str, Candidate], unknown: list[str]) -> Plan:
    """The `Plan` of the chosen candidate placed as `placement`; `results` are every scored
    schedule (the program order's lower bound is reported beside the chosen one's)."""
    order, live, offsets = best.order, best.live, placement.offsets
    fused, scratch, external = best.analysis.fusion.fused, best.analysis.scratch, best.analysis.roles.external
    n = len(order)
    pos = [0] * len(g.ops)
    for p, oi in enumerate(order):
        pos[oi] = p
    steps: list[Step] = []
    for p, oi in enumerate(order):
        op = g.ops[oi]
        all_fused = False   # some output, and every one fused
        for v in op.outputs:
            if v is not None:
                if not fused[v]:
                    all_fused = False
                    break
                all_fused = True
        # positional: Step(index, eqn, primitive, operands, outputs, fused, scratch_bytes, source)
        steps.append(Step(p, op.eqn, op.primitive, list(op.operands), list(op.outputs), all_fused,
                          scratch.get(oi, 0), op.source))
    values: dict[int, ValueInfo] = {}
    for v in range(g.num_values):
        prod = g.producer[v]
        if prod == DROPPED:
            continue  # made by dead code that was dropped
        gid = live.group[v]
        values[v] = ValueInfo(v, g.shapes[v], g.dtypes[v], g.nbytes[v],
                              None if prod < 0 else pos[prod], gid if gid >= 0 else None, g.sources[v])
    buffers: list[PlannedBuffer] = []
    for iv in live.intervals:
        members = list(iv.members) if len(iv.members) < 2 else \
            sorted(iv.members, key=lambda v: -1 if g.producer[v] < 0 else pos[g.producer[v]])
        root = members[0] if members else None
        if root is None:
            op = g.ops[iv.op]
            label, shape, dtype, source = f"{op.primitive} scratch", (), "", op.source
        else:
            prod = g.producer[root]
            label = "argument" if prod < 0 else g.ops[prod].primitive
            shape, dtype, source = g.shapes[root], g.dtypes[root], g.sources[root]
        # positional: (id, offset, size, start, end, values, kind, category, shape, dtype, source, label)
        buffers.append(PlannedBuffer(iv.id, offsets[iv.id], iv.size, iv.start, iv.end, members, iv.kind,
                                     _CATEGORY.get(iv.kind, "temporaries"), shape, dtype, source, label))
    external_bytes = sum(g.nbytes[v] for v in dict.fromkeys(g.invars) if external[v])
    output_bytes = sum(g.outvar_bytes)
    return Plan(
        peak_bytes=external_bytes + placement.arena,
        arena_bytes=placement.arena,
        argument_bytes=sum(g.nbytes[v] for v in g.invars),
        output_bytes=output_bytes,
        lower_bound_bytes=external_bytes + live.peak,
        program_order_lower_bound_bytes=external_bytes + results["program"].peak,
        schedule=steps,
        buffers=buffers,
        values=values,
        invars=list(g.invars),
        outvars=[None if isinstance(v, Const) else v for v in g.outvars],
        donated=tuple(k for k, d in enumerate(flags) if d),
        num_eqns=g.num_eqns,
        unknown_primitives=unknown,
        scheduler=scheduler,
        placement=placement.name,
        closed_jaxpr=g.closed_jaxpr,
        var_ids=dict(g.var_ids),
        schedule_peaks={k: c.peak for k, c in results.items()},
        fused_values=sum(1 for v in range(g.num_values) if fused[v]),
        external_outputs=tuple(dict.fromkeys(v for v in g.outvars
                                             if not isinstance(v, Const) and g.producer[v] >= 0 and external[v])),
    )
