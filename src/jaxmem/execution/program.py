"""A plan compiled to one Python function that runs every step inside one host arena.

Each value with a buffer gets a typed numpy view at its planned offset, made once when the
program is bound to an arena. The schedule becomes the body of a single generated function:
one line per step (`np.add(V3, V7, out=V9)`, `copyto(V12, K4(V9))`, `t15 = K5(V12)`), so a call
is one tight loop with no per-step dispatch in Python beyond the kernel call itself. Fused
transients are local variables of that function, dropped after their last use.

    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.compiler.planner import plan_jaxpr
    >>> f, x = lambda x: jnp.sin(x) * 2, np.ones(4, np.float32)
    >>> p = plan_jaxpr(jax.make_jaxpr(f)(x))
    >>> program = compile_plan(p, np.empty(p.arena_bytes, np.uint8))
    >>> program.run([x])
    (array([1.682942, 1.682942, 1.682942, 1.682942], dtype=float32),)

What the compiler decides statically, from the plan's offsets:
- A step whose output overlaps one of its inputs' bytes (in place, or a view of one) writes
  straight into the output only when its kernel is known to be right under overlap (numpy
  ufuncs, an update written into its own operand); otherwise it computes into a temporary.
- A transient that is a view of arena bytes is copied when it is made if any step before its
  last use overwrites those bytes (the plan may reuse memory a fused consumer still reads).
- A view whose output sits at its operand's own offset (reshape in place) emits nothing.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.plan_types import Const, Plan
from jaxmem.errors import PlanError
from jaxmem.execution.primitives import Kernel, kernel_for, storage
from jaxmem.execution.tracing import const_array

Region = tuple[int, int]


PLAN_FILE = "<jaxmem plan>"   # the file name of the generated code, in tracebacks and warnings


@dataclass
class Program:
    """A plan bound to one arena: `run(flat_inputs) -> flat outputs` (fresh numpy arrays)."""

    plan: Plan
    memory: np.ndarray                 # the arena: uint8, at least plan.arena_bytes long
    run_flat: Callable[..., tuple[Any, ...]]
    source: str                        # the generated function, for debugging and tests
    kernels: list[Kernel] = field(default_factory=list)
    temporaries: int = 0               # steps that compute into a temporary (overlap)
    materialized: int = 0              # transient views copied because their bytes get reused
    elided: int = 0                    # in-place views that need no work
    chained: int = 0                   # fused intermediates computed in the next step's slot
    line_steps: dict[int, int] = field(default_factory=dict)  # generated line -> step index

    def run(self, inputs: Sequence[np.ndarray]) -> tuple[Any, ...]:
        """Run every step; `inputs` are the flat arguments as numpy arrays of the traced dtypes.

        A floating-point warning numpy would raise in a step (an overflow in `exp`) is issued
        at the user's line that made that step, not at the generated code's; numpy's own
        settings (`np.seterr`: ignore, raise, ...) are kept."""
        modes = {kind: ("call" if mode == "warn" else mode) for kind, mode in np.geterr().items()}
        with np.errstate(call=self._float_warning, **modes):
            return self.run_flat(*inputs)

    def _float_warning(self, kind: str, flag: int) -> None:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename != PLAN_FILE:
            frame = frame.f_back
        step = self.plan.schedule[self.line_steps[frame.f_lineno]] if frame and frame.f_lineno in self.line_steps else None
        message = RuntimeWarning(f"{kind} encountered in {step.primitive if step else 'a planned step'}")
        if step is None or step.source is None:
            warnings.warn(message, stacklevel=2)
            return
        where = step.source
        warnings.warn_explicit(message, RuntimeWarning, where.file, where.line,
                               module=os.path.splitext(os.path.basename(where.file))[0], registry=_WARNED)


# Which (message, category, line) a planned step has warned about already, as a module's
# __warningregistry__ keeps it, so a warning in a loop prints once.
_WARNED: dict[Any, Any] = {}


def check_arena(plan: Plan, memory: np.ndarray) -> None:
    """Refuse an arena that is not a flat uint8 buffer of at least the plan's size."""
    if not isinstance(memory, np.ndarray) or memory.dtype != np.uint8 or memory.ndim != 1:
        raise PlanError("the arena must be a one-dimensional numpy uint8 array")
    if not memory.flags.writeable or not memory.flags.c_contiguous:
        raise PlanError("the arena must be writable and contiguous")
    if memory.nbytes < plan.arena_bytes:
        raise PlanError(f"arena of {memory.nbytes} bytes is smaller than the plan's {plan.arena_bytes} bytes "
                        f"({plan.arena_bytes - memory.nbytes} short)")
    for buf in plan.buffers:
        if buf.offset < 0 or buf.offset + buf.size > plan.arena_bytes:
            raise PlanError(f"invalid plan: buffer {buf.id} ({buf.label}) at [{buf.offset}, "
                            f"{buf.offset + buf.size}) lies outside the arena of {plan.arena_bytes} bytes")


def _overlaps(a: Region, b: Region) -> bool:
    return a[0] < b[1] and b[0] < a[1] and a[0] < a[1] and b[0] < b[1]


def _avals(plan: Plan) -> dict[int, Any]:
    """ValueId -> aval, read from the equations that define and use each value."""
    avals: dict[int, Any] = {}
    for aval, vid in zip(ja.jaxpr_in_avals(plan.closed_jaxpr), plan.invars):
        avals[vid] = aval
    for step in plan.schedule:
        for aval, vid in zip(ja.eqn_out_avals(step.eqn), step.outputs):
            if vid is not None:
                avals[vid] = aval
        for aval, op in zip(ja.eqn_in_avals(step.eqn), step.operands):
            if not isinstance(op, Const) and op not in avals:
                avals[op] = aval
    return avals


def compile_plan(plan: Plan, memory: np.ndarray) -> Program:
    """Bind `plan` to the arena `memory` and generate the function that runs its schedule.

    **Arguments:** `plan`, a valid Plan with its `closed_jaxpr`; `memory`, a uint8 array of at
    least `plan.arena_bytes` bytes (raises `PlanError` otherwise).

    **Returns:** a `Program`.
    """
    check_arena(plan, memory)
    if plan.closed_jaxpr is None:
        raise PlanError("the plan carries no jaxpr to run")
    avals = _avals(plan)
    ns: dict[str, Any] = {"copyto": np.copyto, "array": np.array}
    consts: dict[int, str] = {}

    def const_name(arr: np.ndarray) -> str:
        key = id(arr)
        if key not in consts:
            consts[key] = f"C{len(consts)}"
            ns[consts[key]] = arr
        return consts[key]

    # -- where each value lives -------------------------------------------------------------
    region: dict[int, Region] = {}          # values with a slot in the arena
    arg_pos = {vid: k for k, vid in enumerate(plan.invars)}
    for vid, info in plan.values.items():
        loc = plan.location(vid)
        if loc is None:
            continue
        off, nbytes = loc
        aval = avals.get(vid)
        if aval is None:
            continue  # a value nothing reads or writes (dropped by the planner's dead-code pass)
        dtype, shape = storage(aval)
        if ja.element_bits(dtype) < 8:
            continue  # XLA packs int4/int2/fp4 (the plan's bytes); numpy holds one a byte: kept outside
        if dtype.itemsize * int(np.prod(shape, dtype=np.int64)) != nbytes:
            raise PlanError(f"invalid plan: value {vid} is {nbytes} bytes but its type {aval} needs "
                            f"{dtype.itemsize * int(np.prod(shape, dtype=np.int64))}")
        ns[f"V{vid}"] = memory[off:off + nbytes].view(dtype).reshape(shape)
        region[vid] = (off, off + nbytes)

    uses: dict[int, list[int]] = {}
    for step in plan.schedule:
        for op in step.operands:
            if not isinstance(op, Const):
                uses.setdefault(op, []).append(step.index)
    end = len(plan.schedule)
    for vid in plan.outvars:
        if vid is not None:
            uses.setdefault(vid, []).append(end)
    writes: list[list[Region]] = [[region[v] for v in s.outputs if v is not None and v in region]
                                  for s in plan.schedule]

    roots: dict[int, list[Region]] = {}     # arena bytes a transient may be a view of

    def expr(op: Any, aval: Any) -> str:
        if isinstance(op, Const):
            return const_name(const_array(op.value, aval))
        if op in region:
            return f"V{op}"
        if op in arg_pos:
            return f"a{arg_pos[op]}"
        return f"t{op}"

    def roots_of(op: Any) -> list[Region]:
        if isinstance(op, Const):
            return []
        if op in region:
            return [region[op]]
        return roots.get(op, [])

    lines: list[str] = []
    for k, vid in enumerate(plan.invars):
        if vid in region:  # donated: the argument's bytes move into the arena
            lines.append(f"copyto(V{vid}, a{k})")

    program_kernels: list[Kernel] = [kernel_for(step.eqn) for step in plan.schedule]
    temporaries = materialized = elided = chained = 0
    first_line: list[tuple[int, int]] = []   # (index in `lines`, step) where each step's code starts
    for step in plan.schedule:
        i = step.index
        first_line.append((len(lines), i))
        kernel = program_kernels[i]
        ns[f"K{i}"] = kernel.compute
        in_avals = ja.eqn_in_avals(step.eqn)
        ins = [expr(op, a) for op, a in zip(step.operands, in_avals)]
        in_roots = [roots_of(op) for op in step.operands]
        outs = step.outputs
        live_outs = [o for o in outs if o is not None]
        args = ", ".join(ins)

        if len(outs) == 1 and outs[0] is not None and outs[0] in region:
            o = outs[0]
            oreg = region[o]
            clash = [j for j, rs in enumerate(in_roots) if any(_overlaps(oreg, r) for r in rs)]
            if (kernel.same_bytes and step.operands and not isinstance(step.operands[0], Const)
                    and step.operands[0] in region and region[step.operands[0]] == oreg):
                elided += 1
                lines.append(f"pass  # {step.primitive}: in place")
                continue
            exact_ok = all(j in kernel.alias_ok and step.operands[j] in region
                           and region[step.operands[j]] == oreg for j in clash)
            if kernel.into is not None and (not clash or kernel.overlap_safe or exact_ok):
                if kernel.ufunc is not None:
                    ns[f"U{i}"] = kernel.ufunc
                    lines.append(f"U{i}({args}, out=V{o})")
                else:
                    ns[f"I{i}"] = kernel.into
                    lines.append(f"I{i}(V{o}{', ' if args else ''}{args})")
            else:
                if clash:
                    temporaries += 1
                lines.append(f"copyto(V{o}, K{i}({args}))")
        elif len(outs) == 1:
            o = outs[0]
            call = f"K{i}({args})"
            dest = _chain_dest(plan, i, o, uses, region, program_kernels, avals, in_roots, roots_of)
            if o is None:
                lines.append(call)
            elif dest is not None:
                # Computed straight into the next step's output slot, which that elementwise
                # step then updates in place: no fresh memory for the fused intermediate.
                chained += 1
                if kernel.ufunc is not None:
                    ns[f"U{i}"] = kernel.ufunc
                    lines.append(f"U{i}({args}, out=V{dest})")
                else:
                    ns[f"I{i}"] = kernel.into
                    lines.append(f"I{i}(V{dest}{', ' if args else ''}{args})")
                lines.append(f"t{o} = V{dest}")
                roots[o] = [region[dest]]
            else:
                r = [reg for rs in in_roots for reg in rs] if kernel.views else []
                if r and _reused_before_last_use(r, i, max(uses.get(o, [i])), writes):
                    call, r = f"array({call})", []
                    materialized += 1
                roots[o] = r
                lines.append(f"t{o} = {call}")
        else:
            out_regions = [region[o] for o in live_outs if o in region]
            all_roots = [reg for rs in in_roots for reg in rs]
            clash = any(_overlaps(a, b) for a in out_regions for b in all_roots)
            lines.append(f"r = K{i}({args})")
            if clash:
                temporaries += 1
                lines.append("r = [array(x) for x in r]")
            for j, o in enumerate(outs):
                if o is None:
                    continue
                if o in region:
                    lines.append(f"copyto(V{o}, r[{j}])")
                else:
                    r = all_roots if (kernel.views and not clash) else []
                    call = f"r[{j}]"
                    if r and _reused_before_last_use(r, i, max(uses.get(o, [i])), writes):
                        call, r = f"array(r[{j}])", []
                        materialized += 1
                    roots[o] = r
                    lines.append(f"t{o} = {call}")
        # drop transients at their last use, as a fused kernel drops its registers
        dead = sorted({op for op in step.operands if not isinstance(op, Const) and op not in region
                       and op not in arg_pos and max(uses[op]) == i})
        dead += [o for o in live_outs if o not in region and o not in uses]
        if dead:
            lines.append("del " + ", ".join(f"t{v}" for v in dead))

    results = []
    for j, vid in enumerate(plan.outvars):
        if vid is None:
            value, aval = ja.constant_output(plan.closed_jaxpr, j)
            results.append(f"array({const_name(const_array(value, aval))})")
        else:
            results.append(f"array({expr(vid, avals.get(vid))})")
    params = ", ".join(f"a{k}" for k in range(len(plan.invars)))
    body = "\n".join("    " + line for line in lines) or "    pass"
    source = f"def run({params}):\n{body}\n    return ({', '.join(results)}{',' if results else ''})\n"
    code = compile(source, PLAN_FILE, "exec")
    exec(code, ns)
    # Line k of `lines` is line k + 2 of the source (after `def run(...)`).
    bounds = first_line + [(len(lines), -1)]
    line_steps = {line + 2: i for (start, i), (end, _) in zip(bounds, bounds[1:]) for line in range(start, end)}
    return Program(plan=plan, memory=memory, run_flat=ns["run"], source=source, kernels=program_kernels,
                   temporaries=temporaries, materialized=materialized, elided=elided, chained=chained,
                   line_steps=line_steps)


def _chain_dest(plan: Plan, i: int, o: Any, uses: dict[int, list[int]], region: dict[int, Region],
                kernels: list[Kernel], avals: dict[int, Any], in_roots: list[list[Region]],
                roots_of: Callable[[Any], list[Region]]) -> int | None:
    """The value whose slot transient `o` of step `i` can be computed in, or None.

    That is the output slot of step i+1 when step i+1 is the only reader of `o`, is an
    elementwise kernel that is right in place (it reads `o` element for element while writing
    the same bytes), makes a value of `o`'s very type, and no other input of either step
    touches that slot (writing it one step early must not clobber anything still to be read).
    """
    kernel = kernels[i]
    if o is None or kernel.into is None or uses.get(o) != [i + 1] or i + 1 >= len(plan.schedule):
        return None
    nxt = plan.schedule[i + 1]
    consumer = kernels[i + 1]
    if len(nxt.outputs) != 1 or nxt.outputs[0] not in region or consumer.into is None or not consumer.overlap_safe:
        return None
    dest = nxt.outputs[0]
    if avals.get(dest) is None or avals.get(o) is None or storage(avals[dest]) != storage(avals[o]):
        return None
    dreg = region[dest]
    # step i's own inputs may share the slot only when its kernel is right under overlap (a
    # ufunc, say, over the conv output whose bytes the plan hands on to step i+1)
    if not kernel.overlap_safe and any(_overlaps(dreg, r) for rs in in_roots for r in rs):
        return None
    for op in nxt.operands:
        if op == o or isinstance(op, Const):
            continue
        if any(_overlaps(dreg, r) for r in roots_of(op)):
            return None
    return dest


def _reused_before_last_use(roots: list[Region], made: int, last: int, writes: list[list[Region]]) -> bool:
    """True when a step after `made` and before `last` writes over any of `roots`."""
    for s in range(made + 1, min(last, len(writes))):
        for w in writes[s]:
            for r in roots:
                if _overlaps(w, r):
                    return True
    return False
