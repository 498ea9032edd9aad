"""A flat, rewritable copy of a traced function: the graph the rematerialization pass edits.

`trace(fn, *args)` traces `fn` with `jax.make_jaxpr`, inlines call-like primitives (jit/pjit,
closed_call, checkpoint, custom_jvp_call, custom_vjp_call) so every equation sits at one level,
and renames every variable to an int. The jaxpr itself is never mutated: a `Node` keeps the
equation it came from and the operands it reads after renaming, and a rewrite builds new node
lists. `as_function(graph)` turns a graph back into a plain function of the same pytree
arguments, one `Primitive.bind` per node, that `jax.jit` and `jax.make_jaxpr` accept.

>>> import jax.numpy as jnp
>>> g = trace(lambda x: jnp.sin(x) * 2, jnp.ones(3))
>>> [n.primitive for n in g.nodes]
['sin', 'mul']
>>> float(as_function(g)(jnp.zeros(3))[0])
0.0
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.extend.core as jex

from jaxmem.compiler.costs import aval_bytes
from jaxmem.compiler.plan_types import Const, SourceLine
from jaxmem.errors import PlanError

# Primitives whose body is inlined: they only group equations, they compute nothing themselves.
# custom_jvp/custom_vjp lose their custom derivative rule when inlined; the rewritten function
# computes the same values, which is what remat promises (it is applied to a finished step).
_CALLS = {
    "pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "remat": "jaxpr", "checkpoint": "jaxpr", "remat2": "jaxpr",
    "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "custom_lin": None,
}

_SKIP_DIRS = (os.sep + "jax" + os.sep, os.sep + "jaxlib" + os.sep,
              os.sep + os.path.join("jaxmem", "compiler") + os.sep, os.sep + os.path.join("jaxmem", "execution") + os.sep)


@dataclass(frozen=True)
class Node:
    """One equation of the flat program.

    `eqn` is the original jaxpr equation (read-only), or None for a recompute group that remat
    inserted: then `body` holds the recomputed nodes, `ins` their operands (the last one an
    anchor that only orders the group), `outs` the copies later nodes read, and `guard` how the
    group is kept from being merged back into the original by XLA ("cond" or "barrier").
    `ins` are value ids or `Const` literals; `outs` are value ids, None for a dropped output.
    `origin` is the index in the original program of the node this one recomputes (or is).
    """

    eqn: Any
    ins: tuple[int | Const, ...]
    outs: tuple[int | None, ...]
    origin: int
    recompute: bool = False
    body: tuple["Node", ...] = ()
    guard: str = ""
    body_ins: tuple[int, ...] = ()   # the ids `body` reads, bound positionally to `ins`
    through: tuple[tuple[int, int], ...] = ()  # (out id, body_ins id): operands handed back
                                               # unchanged, so their later readers wait for it

    @property
    def primitive(self) -> str:
        return f"remat[{self.guard}]" if self.eqn is None else self.eqn.primitive.name

    @property
    def inputs(self) -> list[int]:
        return [v for v in self.ins if not isinstance(v, Const)]


@dataclass(frozen=True)
class ValueMeta:
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    source: SourceLine | None
    aval: Any = None


@dataclass
class Graph:
    """A flat program: nodes in order, the ids of its flat inputs and outputs, value metadata."""

    nodes: list[Node]
    invars: list[int]
    outvars: list[int | Const]
    values: dict[int, ValueMeta]
    consts: dict[int, Any]               # closed-over constants: id -> array
    in_tree: Any
    out_tree: Any
    donated: frozenset[int] = frozenset()  # flat input positions donated
    next_id: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def new_id(self, like: int) -> int:
        """A fresh value id with the same metadata as `like`."""
        vid = self.next_id
        self.next_id += 1
        self.values[vid] = self.values[like]
        return vid

    def with_nodes(self, nodes: list[Node], outvars: list[int | Const]) -> "Graph":
        """A graph sharing this one's metadata, with other nodes and outputs."""
        return Graph(nodes, self.invars, outvars, self.values, self.consts, self.in_tree,
                     self.out_tree, self.donated, self.next_id, self.extra)


def source_line(eqn: Any) -> SourceLine | None:
    """The innermost frame of the user's code that made this equation, or None."""
    info = getattr(eqn, "source_info", None)
    tb = getattr(info, "traceback", None)
    if tb is None:
        return None
    for frame in tb.frames:
        name = frame.file_name
        if not any(part in name for part in _SKIP_DIRS):
            return SourceLine(name, int(frame.line_num), frame.function_name)
    return None


def _meta(var: Any, source: SourceLine | None) -> ValueMeta:
    aval = var.aval
    return ValueMeta(tuple(getattr(aval, "shape", ())), str(getattr(aval, "dtype", "")),
                     aval_bytes(aval), source, aval)


def trace(fn: Callable, *args: Any, donate_argnums: tuple[int, ...] = ()) -> Graph:
    """Trace `fn(*args)` into a flat `Graph`.

    Args:
        fn: a JAX-traceable function.
        *args: example arguments (arrays or pytrees of arrays; only shapes and dtypes matter).
        donate_argnums: positional arguments whose buffers the caller donates.

    Returns:
        The flat graph, with call-like primitives inlined.
    """
    try:
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    except Exception as err:  # a user function that does not trace is a user error
        raise PlanError(f"cannot trace the function: {type(err).__name__}: {err}") from err
    leaves_per_arg = [len(jax.tree.leaves(a)) for a in args]
    donated = set()
    start = 0
    for i, count in enumerate(leaves_per_arg):
        if i in donate_argnums:
            donated.update(range(start, start + count))
        start += count
    graph = Graph([], [], [], {}, {}, jax.tree.structure(args), jax.tree.structure(out_shape),
                  frozenset(donated))
    env: dict[Any, int | Const] = {}
    for var in closed.jaxpr.invars:
        env[var] = _fresh(graph, var, None)
        graph.invars.append(env[var])  # type: ignore[arg-type]
    for var, value in zip(closed.jaxpr.constvars, closed.consts):
        vid = _fresh(graph, var, None)
        graph.consts[vid] = value
        env[var] = vid
    _inline(graph, closed.jaxpr, env)
    graph.outvars = [_read(env, v) for v in closed.jaxpr.outvars]
    return graph


def _fresh(graph: Graph, var: Any, source: SourceLine | None) -> int:
    vid = graph.next_id
    graph.next_id += 1
    graph.values[vid] = _meta(var, source)
    return vid


def _read(env: dict[Any, int | Const], var: Any) -> int | Const:
    if isinstance(var, jex.Literal):
        return Const(var.val)
    return env[var]


def _callee(eqn: Any) -> tuple[Any, list[Any]] | None:
    key = _CALLS.get(eqn.primitive.name, "")
    if not key:
        return None
    sub = eqn.params.get(key)
    if sub is None:
        return None
    if isinstance(sub, jex.ClosedJaxpr):
        return sub.jaxpr, list(sub.consts)
    if isinstance(sub, jex.Jaxpr):
        return sub, []
    return None


def _inline(graph: Graph, jaxpr: Any, env: dict[Any, int | Const]) -> None:
    for eqn in jaxpr.eqns:
        callee = _callee(eqn)
        if callee is not None:
            sub, consts = callee
            sub_env: dict[Any, int | Const] = {}
            for var, value in zip(sub.constvars, consts):
                vid = _fresh(graph, var, None)
                graph.consts[vid] = value
                sub_env[var] = vid
            for inner, outer in zip(sub.invars, eqn.invars):
                sub_env[inner] = _read(env, outer)
            _inline(graph, sub, sub_env)
            for outer, inner in zip(eqn.outvars, sub.outvars):
                if not isinstance(outer, jex.DropVar):
                    env[outer] = _read(sub_env, inner)
            continue
        source = source_line(eqn)
        ins = tuple(_read(env, v) for v in eqn.invars)
        outs = []
        for var in eqn.outvars:
            if isinstance(var, jex.DropVar):
                outs.append(None)
            else:
                env[var] = _fresh(graph, var, source)
                outs.append(env[var])
        graph.nodes.append(Node(eqn, ins, tuple(outs), len(graph.nodes)))


def _bind_params(prim: Any, params: dict[str, Any]) -> dict[str, Any]:
    # JAX releases differ: get_bind_params returns params, or (subfuns, params) with subfuns
    # empty for every primitive remat leaves un-inlined.
    got = prim.get_bind_params(params)
    if isinstance(got, tuple):
        subfuns, got = got
        if subfuns:
            raise PlanError(f"cannot re-run primitive {prim.name}: it binds sub-functions")
    return got


def run(graph: Graph, flat_args: list[Any]) -> list[Any]:
    """Evaluate the graph on flat arguments, one `bind` per node; works under tracing too."""
    env: dict[int, Any] = dict(graph.consts)
    env.update(zip(graph.invars, flat_args))

    def read(v: int | Const) -> Any:
        return v.value if isinstance(v, Const) else env[v]

    _run_nodes(graph.nodes, env)
    return [read(v) for v in graph.outvars]


def _run_nodes(nodes: Any, env: dict[int, Any]) -> None:
    def read(v: int | Const) -> Any:
        return v.value if isinstance(v, Const) else env[v]

    for node in nodes:
        invals = [read(v) for v in node.ins]
        if node.eqn is None:
            outvals = _run_group(node, invals, env)
        else:
            prim = node.eqn.primitive
            result = prim.bind(*invals, **_bind_params(prim, node.eqn.params))
            outvals = list(result) if prim.multiple_results else [result]
        for vid, val in zip(node.outs, outvals):
            if vid is not None:
                env[vid] = val


def _run_group(node: Node, invals: list[Any], env: dict[int, Any]) -> list[Any]:
    """Run a recompute group so that XLA keeps it a separate computation.

    "barrier": the operands pass through `optimization_barrier`, as `jax.checkpoint` does.
    XLA:CPU removes barriers early in its pipeline and a later CSE pass then merges the copy
    with the original (measured: jax.checkpoint saves nothing there), so on CPU the group is the
    taken branch of a `cond` whose predicate is always true but not provably so to XLA, read
    from the anchor. XLA does not CSE across computations, and the cond cannot run before the
    anchor exists. (Identical branches do not work: XLA hoists code common to all branches
    out of the cond, and CSE merges it back.)
    """
    # Later rewrites may rename the group's operands (`ins`); its body keeps reading the ids it
    # was built with, bound here by position. Anything else it reads is a closed-over constant.
    ids = node.body_ins
    made = {vid for n in node.body for vid in n.outs}
    consts = {vid: env[vid] for n in node.body for vid in n.inputs if vid not in ids and vid not in made}

    def body(*operands: Any) -> list[Any]:
        inner = dict(consts)
        inner.update(zip(ids, operands))
        _run_nodes(node.body, inner)
        inner.update((out, inner[src]) for out, src in node.through)
        return [inner[v] if v is not None else None for v in node.outs]

    if node.guard == "barrier":
        return body(*jax.lax.optimization_barrier(tuple(invals)))
    # The predicate is always true, but XLA cannot prove it: the population count of any
    # 32-bit word is at most 32. The other branch returns zeros, so the branches differ and
    # XLA's conditional code motion cannot hoist the recomputation out of the cond.
    word = jax.numpy.ravel(jax.numpy.real(invals[-1]))[0].astype(jax.numpy.uint32)
    pred = jax.lax.population_count(word) <= 32
    shapes = jax.eval_shape(body, *invals)

    def never(*operands: Any) -> list[Any]:
        return [jax.numpy.zeros(a.shape, a.dtype) for a in shapes]

    return list(jax.lax.cond(pred, body, never, *invals))


def as_function(graph: Graph) -> Callable:
    """A plain function of the original pytree arguments that runs the graph.

    It returns the original output pytree; `jax.jit` and `jax.make_jaxpr` accept it.
    """

    def rewritten(*args: Any) -> Any:
        leaves, tree = jax.tree.flatten(args)
        if tree != graph.in_tree:
            raise PlanError(f"arguments do not match the traced structure: {tree} vs {graph.in_tree}")
        return jax.tree.unflatten(graph.out_tree, run(graph, leaves))

    rewritten.__name__ = "rematerialized"
    return rewritten
