"""A flat, rewritable copy of a traced function: the graph the rematerialization pass edits.

`trace(fn, *args)` takes the front end's program of `fn` (`jaxpr_adapter.trace` and `inline`:
call-like primitives inlined, every variable renamed to an int), one node per op. The jaxpr itself is never mutated: a `Node` keeps the
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

import re
from dataclasses import dataclass
from typing import Any, Callable

import jax

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.plan_types import Const, SourceLine
from jaxmem.errors import PlanError


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
        return f"remat[{self.guard}]" if self.eqn is None else ja.eqn_name(self.eqn)

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
    """A flat program: nodes in order, the ids of its flat inputs and outputs, value metadata.
    Literals and closed-over constants are `Const` operands, as in `program.Program`."""

    nodes: list[Node]
    invars: list[int]
    outvars: list[int | Const]
    values: dict[int, ValueMeta]
    in_tree: Any
    out_tree: Any
    donated: frozenset[int] = frozenset()  # flat input positions donated
    next_id: int = 0

    def new_id(self, like: int) -> int:
        """A fresh value id with the same metadata as `like`."""
        vid = self.next_id
        self.next_id += 1
        self.values[vid] = self.values[like]
        return vid

    def with_nodes(self, nodes: list[Node], outvars: list[int | Const]) -> "Graph":
        """A graph sharing this one's metadata, with other nodes and outputs."""
        return Graph(nodes, self.invars, outvars, self.values, self.in_tree, self.out_tree, self.donated,
                     self.next_id)


def trace(fn: Callable, *args: Any, donate_argnums: int | tuple[int, ...] = ()) -> Graph:
    """Trace `fn(*args)` into a flat `Graph`: the front end's program (`jaxpr_adapter.inline`),
    one node per op, ready to be rewritten.

    Args:
        fn: a JAX-traceable function.
        *args: example arguments (arrays or pytrees of arrays; only shapes and dtypes matter).
        donate_argnums: positional arguments whose buffers the caller donates.

    Returns:
        The flat graph, with call-like primitives inlined.
    """
    traced = ja.trace(fn, args, donate_argnums=donate_argnums)
    p = ja.inline(traced.closed_jaxpr)
    values = {v: ValueMeta(p.shapes[v], p.dtypes[v], p.nbytes[v], p.sources[v], p.avals[v])
              for v in range(p.num_values)}
    nodes = [Node(op.eqn, tuple(op.operands), tuple(op.outputs), k) for k, op in enumerate(p.ops)]
    return Graph(nodes, list(p.invars), list(p.outvars), values, traced.in_tree, traced.out_tree,
                 frozenset(traced.donated), p.num_values)


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _static_text(tree: Any) -> str:
    """A treedef's text with object addresses removed: closures and bound methods made again by
    the same code compare equal, as they would when `jax.jit` hashes a rebuilt state's statics."""
    return _ADDRESS.sub("", str(tree))


def check_arguments(graph: Graph, args: tuple[Any, ...]) -> list[Any]:
    """The flat leaves of `args` when they match what the graph was traced with, else a
    one-line `PlanError` naming the first argument path that differs."""
    with_paths, tree = jax.tree_util.tree_flatten_with_path(args)
    if tree != graph.in_tree:
        skeleton = jax.tree.unflatten(graph.in_tree, [None] * graph.in_tree.num_leaves)
        traced = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(
            skeleton, is_leaf=lambda x: x is None)[0]]
        given = [jax.tree_util.keystr(p) for p, _ in with_paths]
        for k in range(max(len(traced), len(given))):
            if k >= len(traced) or k >= len(given) or traced[k] != given[k]:
                got = f"args{given[k]}" if k < len(given) else "nothing"
                want = f"args{traced[k]}" if k < len(traced) else "nothing"
                raise PlanError(f"arguments differ from those fit traced: {got[:120]} where it traced {want[:120]}")
        if _static_text(tree) != _static_text(graph.in_tree):
            raise PlanError("arguments have the traced leaves but other static fields (a pytree's "
                            "non-array attributes differ from those fit traced)")
    leaves = [leaf for _, leaf in with_paths]
    for (path, leaf), vid in zip(with_paths, graph.invars):
        meta = graph.values[vid]
        shape = tuple(getattr(leaf, "shape", ()))
        dtype = getattr(leaf, "dtype", None)
        if shape != tuple(meta.shape) or (dtype is not None and str(dtype) != meta.dtype):
            raise PlanError(f"argument args{jax.tree_util.keystr(path)[:120]} is "
                            f"{dtype or type(leaf).__name__}{list(shape)} where fit traced {meta.dtype}{list(meta.shape)}")
    return leaves


def run(graph: Graph, flat_args: list[Any]) -> list[Any]:
    """Evaluate the graph on flat arguments, one `bind` per node; works under tracing too."""
    env: dict[int, Any] = dict(zip(graph.invars, flat_args))

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
            outvals = ja.bind(node.eqn, invals)
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
    # was built with, bound here by position. Anything else it reads comes from the caller's env.
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

    It returns the original output pytree; `jax.jit` and `jax.make_jaxpr` accept it. Like the
    original under `jax.jit`, it takes any arguments whose leaves have the traced shapes and
    dtypes and whose static structure is the traced one (a state rebuilt by the same factory,
    with new closures in it, is the same); anything else is a one-line `PlanError` naming the
    first argument that differs.
    """

    def rewritten(*args: Any) -> Any:
        return jax.tree.unflatten(graph.out_tree, run(graph, check_arguments(graph, args)))

    rewritten.__name__ = "rematerialized"
    return rewritten
