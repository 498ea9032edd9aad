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
from jaxmem.compiler.plan_types import Const, Plan, Step
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
    region = _bind_values(plan, memory, avals, ns)
    uses = _uses(plan)
    writes: list[list[Region]] = [[region[v] for v in s.outputs if v is not None and v in region]
                                  for s in plan.schedule]
    gen = _Generator(plan=plan, avals=avals, ns=ns, region=region,
                     arg_pos={vid: k for k, vid in enumerate(plan.invars)}, uses=uses, writes=writes)
    gen.emit_arguments()
    gen.kernels = [kernel_for(step.eqn) for step in plan.schedule]
    for step in plan.schedule:
        gen.emit_step(step)
    source = gen.source()
    code = compile(source, PLAN_FILE, "exec")
    exec(code, ns)
    return Program(plan=plan, memory=memory, run_flat=ns["run"], source=source, kernels=gen.kernels,
                   temporaries=gen.temporaries, materialized=gen.materialized, elided=gen.elided,
                   chained=gen.chained, line_steps=gen.line_steps())


def _bind_values(plan: Plan, memory: np.ndarray, avals: dict[int, Any], ns: dict[str, Any]) -> dict[int, Region]:
    """Where each value lives: a typed view `V<id>` of its arena bytes in `ns` for every value
    with a slot; returns those values' byte ranges."""
    region: dict[int, Region] = {}          # values with a slot in the arena
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
    return region


def _uses(plan: Plan) -> dict[int, list[int]]:
    """Per value, the steps that read it, in order; an output is also read at the exit."""
    uses: dict[int, list[int]] = {}
    for step in plan.schedule:
        for op in step.operands:
            if not isinstance(op, Const):
                uses.setdefault(op, []).append(step.index)
    end = len(plan.schedule)
    for vid in plan.outvars:
        if vid is not None:
            uses.setdefault(vid, []).append(end)
    return uses


@dataclass
class _Generator:
    """The generated function as it is written, step by step: its lines, the namespace they run
    in, and the arena bytes each transient may be a view of."""

    plan: Plan
    avals: dict[int, Any]
    ns: dict[str, Any]
    region: dict[int, Region]               # values with a slot in the arena
    arg_pos: dict[int, int]
    uses: dict[int, list[int]]
    writes: list[list[Region]]              # per step, the arena bytes it writes
    kernels: list[Kernel] = field(default_factory=list)
    consts: dict[int, str] = field(default_factory=dict)
    roots: dict[int, list[Region]] = field(default_factory=dict)   # arena bytes a transient may be a view of
    lines: list[str] = field(default_factory=list)
    first_line: list[tuple[int, int]] = field(default_factory=list)  # (index in `lines`, step) where each step's code starts
    temporaries: int = 0
    materialized: int = 0
    elided: int = 0
    chained: int = 0

    def const_name(self, arr: np.ndarray) -> str:
        key = id(arr)
        if key not in self.consts:
            self.consts[key] = f"C{len(self.consts)}"
            self.ns[self.consts[key]] = arr
        return self.consts[key]

    def expr(self, op: Any, aval: Any) -> str:
        if isinstance(op, Const):
            return self.const_name(const_array(op.value, aval))
        if op in self.region:
            return f"V{op}"
        if op in self.arg_pos:
            return f"a{self.arg_pos[op]}"
        return f"t{op}"

    def roots_of(self, op: Any) -> list[Region]:
        if isinstance(op, Const):
            return []
        if op in self.region:
            return [self.region[op]]
        return self.roots.get(op, [])

    def emit_arguments(self) -> None:
        for k, vid in enumerate(self.plan.invars):
            if vid in self.region:  # donated: the argument's bytes move into the arena
                self.lines.append(f"copyto(V{vid}, a{k})")

    def emit_step(self, step: Step) -> None:
        i = step.index
        self.first_line.append((len(self.lines), i))
        kernel = self.kernels[i]
        self.ns[f"K{i}"] = kernel.compute
        in_avals = ja.eqn_in_avals(step.eqn)
        args = ", ".join(self.expr(op, a) for op, a in zip(step.operands, in_avals))
        in_roots = [self.roots_of(op) for op in step.operands]
        outs = step.outputs
        if len(outs) == 1 and outs[0] is not None and outs[0] in self.region:
            if self._emit_stored(step, kernel, args, in_roots):
                return
        elif len(outs) == 1:
            self._emit_transient(step, kernel, args, in_roots)
        else:
            self._emit_several(step, kernel, args, in_roots)
        self._emit_drops(step)

    def _emit_stored(self, step: Step, kernel: Kernel, args: str, in_roots: list[list[Region]]) -> bool:
        """One output with a slot: computed straight into it where that is right, else through a
        temporary. Returns True when the step is a view in place that needs no code."""
        i, o = step.index, step.outputs[0]
        oreg = self.region[o]
        clash = [j for j, rs in enumerate(in_roots) if any(_overlaps(oreg, r) for r in rs)]
        if (kernel.same_bytes and step.operands and not isinstance(step.operands[0], Const)
                and step.operands[0] in self.region and self.region[step.operands[0]] == oreg):
            self.elided += 1
            self.lines.append(f"pass  # {step.primitive}: in place")
            return True
        exact_ok = all(j in kernel.alias_ok and step.operands[j] in self.region
                       and self.region[step.operands[j]] == oreg for j in clash)
        if kernel.into is not None and (not clash or kernel.overlap_safe or exact_ok):
            self._emit_into(i, kernel, args, o)
        else:
            if clash:
                self.temporaries += 1
            self.lines.append(f"copyto(V{o}, K{i}({args}))")
        return False

    def _emit_into(self, i: int, kernel: Kernel, args: str, dest: int) -> None:
        """Step `i` writing its result into the slot of value `dest`."""
        if kernel.ufunc is not None:
            self.ns[f"U{i}"] = kernel.ufunc
            self.lines.append(f"U{i}({args}, out=V{dest})")
        else:
            self.ns[f"I{i}"] = kernel.into
            self.lines.append(f"I{i}(V{dest}{', ' if args else ''}{args})")

    def _emit_transient(self, step: Step, kernel: Kernel, args: str, in_roots: list[list[Region]]) -> None:
        """One output with no slot: a local variable, or the next step's slot (chained)."""
        i, o = step.index, step.outputs[0]
        call = f"K{i}({args})"
        dest = _chain_dest(self.plan, i, o, self.uses, self.region, self.kernels, self.avals, in_roots,
                           self.roots_of)
        if o is None:
            self.lines.append(call)
        elif dest is not None:
            # Computed straight into the next step's output slot, which that elementwise
            # step then updates in place: no fresh memory for the fused intermediate.
            self.chained += 1
            self._emit_into(i, kernel, args, dest)
            self.lines.append(f"t{o} = V{dest}")
            self.roots[o] = [self.region[dest]]
        else:
            r = [reg for rs in in_roots for reg in rs] if kernel.views else []
            call, self.roots[o] = self._copy_if_reused(call, r, i, o)
            self.lines.append(f"t{o} = {call}")

    def _emit_several(self, step: Step, kernel: Kernel, args: str, in_roots: list[list[Region]]) -> None:
        """Several outputs: one call, each result copied into its slot or kept as a local."""
        i, outs = step.index, step.outputs
        out_regions = [self.region[o] for o in outs if o is not None and o in self.region]
        all_roots = [reg for rs in in_roots for reg in rs]
        clash = any(_overlaps(a, b) for a in out_regions for b in all_roots)
        self.lines.append(f"r = K{i}({args})")
        if clash:
            self.temporaries += 1
            self.lines.append("r = [array(x) for x in r]")
        for j, o in enumerate(outs):
            if o is None:
                continue
            if o in self.region:
                self.lines.append(f"copyto(V{o}, r[{j}])")
            else:
                r = all_roots if (kernel.views and not clash) else []
                call, self.roots[o] = self._copy_if_reused(f"r[{j}]", r, i, o)
                self.lines.append(f"t{o} = {call}")

    def _copy_if_reused(self, call: str, roots: list[Region], i: int, o: int) -> tuple[str, list[Region]]:
        """`call` and the arena bytes its result is a view of; a copy (no bytes) when a step
        before the transient's last use writes over them."""
        if roots and _reused_before_last_use(roots, i, max(self.uses.get(o, [i])), self.writes):
            self.materialized += 1
            return f"array({call})", []
        return call, roots

    def _emit_drops(self, step: Step) -> None:
        # drop transients at their last use, as a fused kernel drops its registers
        i = step.index
        dead = sorted({op for op in step.operands if not isinstance(op, Const) and op not in self.region
                       and op not in self.arg_pos and max(self.uses[op]) == i})
        dead += [o for o in step.outputs if o is not None and o not in self.region and o not in self.uses]
        if dead:
            self.lines.append("del " + ", ".join(f"t{v}" for v in dead))

    def source(self) -> str:
        """The whole function: `def run(a0, ...)`, its lines, and the outputs returned as fresh arrays."""
        results = []
        for j, vid in enumerate(self.plan.outvars):
            if vid is None:
                value, aval = ja.constant_output(self.plan.closed_jaxpr, j)
                results.append(f"array({self.const_name(const_array(value, aval))})")
            else:
                results.append(f"array({self.expr(vid, self.avals.get(vid))})")
        params = ", ".join(f"a{k}" for k in range(len(self.plan.invars)))
        body = "\n".join("    " + line for line in self.lines) or "    pass"
        return f"def run({params}):\n{body}\n    return ({', '.join(results)}{',' if results else ''})\n"

    def line_steps(self) -> dict[int, int]:
        """Source line -> the step whose code it is. Line k of `lines` is line k + 2 of the
        source (after `def run(...)`)."""
        bounds = self.first_line + [(len(self.lines), -1)]
        return {line + 2: i for (start, i), (end, _) in zip(bounds, bounds[1:]) for line in range(start, end)}


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
