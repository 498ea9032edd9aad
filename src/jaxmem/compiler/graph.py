"""The value graph of a ClosedJaxpr: values (shape, dtype, bytes), operations, uses, source lines.

Call-like primitives (jit/pjit, closed_call, custom_jvp/vjp calls, remat) are inlined, so one
`Op` is one equation that really runs; scan/while/cond stay one op each. Literals and
closed-over constants become `Const` operands, not values. The jaxpr is never modified; what
the planner learns is kept in side tables indexed by `ValueId` and op index.

    >>> g = build_graph(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(4)))
    >>> [op.primitive for op in g.ops], g.nbytes
    (['sin', 'mul'], [16, 16, 16])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.plan_types import Const, SourceLine, ValueId


@dataclass
class Op:
    """One equation that runs: operands and outputs renamed to graph values."""

    index: int
    eqn: Any
    primitive: str
    operands: list[ValueId | Const]
    outputs: list[ValueId | None]
    inputs: list[ValueId]          # distinct value operands, in first-use order
    source: SourceLine | None


@dataclass
class Graph:
    """Values and ops of one (inlined) jaxpr. Values are numbered 0..n-1 in definition order."""

    shapes: list[tuple[int, ...]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    sources: list[SourceLine | None] = field(default_factory=list)
    producer: list[int] = field(default_factory=list)     # op index, -1 for inputs
    users: list[list[int]] = field(default_factory=list)  # distinct op indices reading it
    ops: list[Op] = field(default_factory=list)
    invars: list[ValueId] = field(default_factory=list)
    outvars: list[ValueId | Const] = field(default_factory=list)
    outvar_bytes: list[int] = field(default_factory=list)  # per output, from its aval
    var_ids: dict[Any, ValueId] = field(default_factory=dict)
    num_eqns: int = 0
    closed_jaxpr: Any = None

    @property
    def num_values(self) -> int:
        return len(self.nbytes)

    def new_value(self, atom: Any, producer: int, source: SourceLine | None) -> ValueId:
        shape, dtype, nbytes = ja.aval_shape_dtype(atom)
        vid = len(self.nbytes)
        self.shapes.append(shape)
        self.dtypes.append(dtype)
        self.nbytes.append(nbytes)
        self.sources.append(source)
        self.producer.append(producer)
        self.users.append([])
        return vid


def count_eqns(jaxpr: Any) -> int:
    """Equations in a jaxpr, counting those inside nested jaxprs too."""
    total = 0
    for eqn in jaxpr.eqns:
        total += 1
        for sub in ja.nested_jaxprs(eqn):
            total += count_eqns(sub)
    return total


def build_graph(closed_jaxpr: Any) -> Graph:
    """Build the inlined value graph of a ClosedJaxpr.

    **Arguments:** `closed_jaxpr`, as `jax.make_jaxpr` returns it (read-only).

    **Returns:** a `Graph`; ops unused by any output and free of effects are dropped (dead code).
    """
    jaxpr, consts = ja.split_closed(closed_jaxpr)
    g = Graph(closed_jaxpr=closed_jaxpr)
    env: dict[Any, ValueId | Const] = {}
    for var, const in zip(jaxpr.constvars, consts):
        env[var] = Const(const)
    for var in jaxpr.invars:
        vid = g.new_value(var, -1, None)
        env[var] = vid
        g.var_ids[var] = vid
        g.invars.append(vid)
    _walk(g, jaxpr, env)
    g.outvars = [_resolve(env, atom) for atom in jaxpr.outvars]
    g.outvar_bytes = [ja.aval_shape_dtype(atom)[2] for atom in jaxpr.outvars]
    g.num_eqns = count_eqns(jaxpr)
    _drop_dead(g)
    return g


def _resolve(env: dict[Any, ValueId | Const], atom: Any) -> ValueId | Const:
    if ja.is_literal(atom):
        return Const(ja.literal_value(atom))
    return env[atom]


def _walk(g: Graph, jaxpr: Any, env: dict[Any, ValueId | Const], outer: SourceLine | None = None) -> None:
    """Add the equations of `jaxpr` to `g`. `outer` is the source line of the call being inlined:
    JAX records only the innermost frames of a traceback, so an equation deep inside a library
    call (jax.nn.relu's body) may have no user frame of its own; it gets its caller's."""
    for eqn in jaxpr.eqns:
        operands = [_resolve(env, a) for a in eqn.invars]
        body = ja.call_body(eqn)
        if body is not None:
            inner, consts = body
            inner_env: dict[Any, ValueId | Const] = {}
            for var, const in zip(inner.constvars, consts):
                inner_env[var] = Const(const)
            for var, operand in zip(inner.invars, operands):
                inner_env[var] = operand
            _walk(g, inner, inner_env, ja.source_line(eqn) or outer)
            for var, atom in zip(eqn.outvars, inner.outvars):
                if ja.is_dropvar(var):
                    continue
                env[var] = _resolve(inner_env, atom)
                if not isinstance(env[var], Const):
                    g.var_ids[var] = env[var]
            continue
        index = len(g.ops)
        source = ja.source_line(eqn) or outer
        outputs: list[ValueId | None] = []
        for var in eqn.outvars:
            if ja.is_dropvar(var):
                outputs.append(None)
                continue
            vid = g.new_value(var, index, source)
            env[var] = vid
            g.var_ids[var] = vid
            outputs.append(vid)
        inputs = list(dict.fromkeys(v for v in operands if not isinstance(v, Const)))
        for v in inputs:
            g.users[v].append(index)
        g.ops.append(Op(index, eqn, ja.eqn_name(eqn), operands, outputs, inputs, source))


def _drop_dead(g: Graph) -> None:
    """Remove effect-free ops none of whose outputs is used (as XLA's DCE would), renumbering ops."""
    needed = [False] * g.num_values
    for v in g.outvars:
        if not isinstance(v, Const):
            needed[v] = True
    keep = [False] * len(g.ops)
    for op in reversed(g.ops):
        effects = getattr(op.eqn, "effects", None)
        if effects or any(v is not None and needed[v] for v in op.outputs):
            keep[op.index] = True
            for v in op.inputs:
                needed[v] = True
    if all(keep):
        return
    new_index: dict[int, int] = {}
    ops: list[Op] = []
    for op in g.ops:
        if keep[op.index]:
            new_index[op.index] = len(ops)
            op.index = len(ops)
            ops.append(op)
    g.ops = ops
    for v in range(g.num_values):
        p = g.producer[v]
        if p >= 0:
            g.producer[v] = new_index.get(p, -2)  # -2: made by a dropped op; no longer exists
        g.users[v] = [new_index[u] for u in g.users[v] if u in new_index]
