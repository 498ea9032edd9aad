"""The one program representation: the values and operations of an inlined jaxpr.

The front end (`jaxpr_adapter.inline`) builds it; the planner, rematerialization and the
executor read it. Call-like primitives (jit/pjit, closed_call, custom_jvp/vjp calls, remat) are
inlined, so one `Op` is one equation that really runs; scan/while/cond stay one op each.
Literals and closed-over constants are `Const` operands, not values. The jaxpr is never
modified; what a stage learns is kept in side tables indexed by `ValueId` and op index.

    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.compiler.jaxpr_adapter import inline
    >>> p = inline(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(4)))
    >>> [op.primitive for op in p.ops], p.nbytes
    (['sin', 'mul'], [16, 16, 16])
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, TypeVar

from jaxmem.compiler.plan_types import Const, SourceLine, ValueId

INPUT = -1       # `Program.producer` of a program input
DROPPED = -2     # `Program.producer` of a value whose op was dropped as dead code
RECOMPUTED = -3  # `Program.producer` of a copy remat made: its op is in a rewrite, not in `ops`


@dataclass
class Op:
    """One equation that runs: operands and outputs renamed to program values.

    Rematerialization rewrites a program by building new op lists, never by changing an op: a
    copy (`renamed`) keeps its original's `index`. A recompute group is an op with no `eqn`
    whose `body` holds the recomputed ops (see `remat_graph`).
    """

    index: int
    eqn: Any                       # the jaxpr equation (read-only), for the executor
    primitive: str
    operands: list[ValueId | Const]
    outputs: list[ValueId | None]  # None for a dropped output (`_`)
    inputs: list[ValueId]          # distinct value operands, in first-use order
    source: SourceLine | None
    effectful: bool = False        # has effects: never dropped, never recomputed
    # remat's rewrites only
    recompute: bool = False        # a recomputed copy (or a recompute group)
    body: tuple["Op", ...] = ()    # a group's recomputed ops
    guard: str = ""                # how XLA is kept from merging a group back: "cond", "barrier"
    body_ins: tuple[ValueId, ...] = ()  # the ids `body` reads, bound positionally to `operands`
    through: tuple[tuple[ValueId, ValueId], ...] = ()  # (output, body_ins id): operands a
                                   # group hands back unchanged, so their later readers wait for it

    @property
    def params(self) -> dict[str, Any]:
        return self.eqn.params

    def renamed(self, operands: list[ValueId | Const], outputs: list[ValueId | None] | None = None,
                **changes: Any) -> "Op":
        """A copy reading `operands` (and making `outputs`); this op is left as it is."""
        inputs = list(dict.fromkeys(v for v in operands if not isinstance(v, Const)))
        return replace(self, operands=list(operands), outputs=list(self.outputs if outputs is None else outputs),
                       inputs=inputs, **changes)


@dataclass
class Program:
    """Values and ops of one inlined jaxpr. Values are numbered 0..n-1 in definition order;
    per-value facts are parallel lists (the planner reads them in its inner loops)."""

    shapes: list[tuple[int, ...]] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)
    avals: list[Any] = field(default_factory=list)
    sources: list[SourceLine | None] = field(default_factory=list)
    producer: list[int] = field(default_factory=list)     # op index, INPUT or DROPPED
    users: list[list[int]] = field(default_factory=list)  # distinct op indices reading it
    ops: list[Op] = field(default_factory=list)
    invars: list[ValueId] = field(default_factory=list)
    outvars: list[ValueId | Const] = field(default_factory=list)
    outvar_bytes: list[int] = field(default_factory=list)  # per output, from its aval
    var_ids: dict[Any, ValueId] = field(default_factory=dict)  # jaxpr Var -> ValueId
    num_eqns: int = 0              # equations counted through nested jaxprs
    closed_jaxpr: Any = None

    @property
    def num_values(self) -> int:
        return len(self.nbytes)

    def new_value(self, shape: tuple[int, ...], dtype: str, nbytes: int, aval: Any, producer: int,
                  source: SourceLine | None) -> ValueId:
        vid = len(self.nbytes)
        self.shapes.append(shape)
        self.dtypes.append(dtype)
        self.nbytes.append(nbytes)
        self.avals.append(aval)
        self.sources.append(source)
        self.producer.append(producer)
        self.users.append([])
        return vid

    def add_op(self, eqn: Any, primitive: str, operands: list[ValueId | Const], outputs: list[ValueId | None],
               source: SourceLine | None, effectful: bool) -> Op:
        index = len(self.ops)
        inputs = list(dict.fromkeys(v for v in operands if not isinstance(v, Const)))
        for v in inputs:
            self.users[v].append(index)
        op = Op(index, eqn, primitive, operands, outputs, inputs, source, effectful)
        self.ops.append(op)
        return op


def drop_dead(p: Program) -> Program:
    """Remove effect-free ops none of whose outputs is used (as XLA's DCE would), renumbering
    ops; values they made keep their ids with producer `DROPPED`. Returns `p`, changed in place."""
    needed = [False] * p.num_values
    for v in p.outvars:
        if not isinstance(v, Const):
            needed[v] = True
    keep = [False] * len(p.ops)
    for op in reversed(p.ops):
        if op.effectful or any(v is not None and needed[v] for v in op.outputs):
            keep[op.index] = True
            for v in op.inputs:
                needed[v] = True
    if all(keep):
        return p
    new_index: dict[int, int] = {}
    ops: list[Op] = []
    for op in p.ops:
        if keep[op.index]:
            new_index[op.index] = len(ops)
            op.index = len(ops)
            ops.append(op)
    p.ops = ops
    for v in range(p.num_values):
        made_by = p.producer[v]
        if made_by >= 0:
            p.producer[v] = new_index.get(made_by, DROPPED)
        p.users[v] = [new_index[u] for u in p.users[v] if u in new_index]
    return p


T = TypeVar("T")

# Per-op side tables of the last op lists seen (`side_table`): the planner scores many schedules
# of one program, and a target's model may rewrite ops (which makes a new list).
TABLES_KEPT = 32
_tables: dict[tuple[int, Any], tuple[list[Op], Any]] = {}


def side_table(p: Program, name: Any, build: Callable[[Program], T]) -> T:
    """`build(p)`, computed once per op list: a fact per op that depends on the ops and the
    values' producers only (both fixed for a given op list), for the hot loops that ask it per
    op, per schedule scored; `name` (hashable) says which fact, with any inputs it depends on.
    The table is shared: treat it as read-only.

    >>> import jax, jax.numpy as jnp
    >>> from jaxmem.compiler.jaxpr_adapter import inline
    >>> q = inline(jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(jnp.ones(4)))
    >>> side_table(q, "names", lambda q: [op.primitive for op in q.ops])
    ['sin', 'mul']
    """
    key = (id(p.ops), name)
    hit = _tables.get(key)
    if hit is not None and hit[0] is p.ops and len(hit[0]) == len(p.ops):
        return hit[1]
    table = build(p)
    _tables.pop(key, None)
    _tables[key] = (p.ops, table)  # holds the list: its id is not reused while kept
    while len(_tables) > TABLES_KEPT:
        del _tables[next(iter(_tables))]
    return table


def forget_side_tables(p: Program, fused: bytes) -> None:
    """Drop `p`'s side tables made for one fusion (their name is a tuple holding `fused`, the
    fused flags as bytes): a plan is done with them, and the garbage collector need not scan
    them, once it runs again, as if they were still in use."""
    for key in [k for k, (ops, _) in _tables.items()
                if ops is p.ops and isinstance(k[1], tuple) and fused in k[1]]:
        del _tables[key]
