"""The rewritable view of a traced function that the rematerialization pass edits.

`trace(fn, *args)` takes the front end's `Program` of `fn` (`jaxpr_adapter.trace` and
`inline`: call-like primitives inlined, every variable renamed to an int). A `Graph` is that
program's ops in the order remat runs them, with the program's value tables: a rewrite builds a
new op list (`Op.renamed` copies, recompute groups), and a recomputed copy of a value is one
more value of the program (producer `RECOMPUTED`). `as_function(graph)` turns a graph back
into a plain function of the same pytree arguments, one `Primitive.bind` per op, that
`jax.jit` and `jax.make_jaxpr` accept.

>>> import jax.numpy as jnp
>>> g = trace(lambda x: jnp.sin(x) * 2, jnp.ones(3))
>>> [op.primitive for op in g.ops]
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
from jaxmem.compiler.plan_types import Const, ValueId
from jaxmem.compiler.program import RECOMPUTED, Op, Program
from jaxmem.errors import PlanError


def group_op(operands: list[ValueId], outputs: list[ValueId], body: list[Op], guard: str,
             through: tuple[tuple[ValueId, ValueId], ...] = ()) -> Op:
    """A recompute group: `body` runs as one op reading `operands` (the last an anchor that only
    orders it) and making `outputs`, the copies later ops read (see `_run_group`)."""
    return Op(-1, None, f"remat[{guard}]", list(operands), list(outputs), list(dict.fromkeys(operands)),
              None, recompute=True, body=tuple(body), guard=guard, body_ins=tuple(operands), through=through)


@dataclass
class Graph:
    """A traced program as remat rewrites it: `ops` in the order they run (recompute groups
    inserted), its outputs, and what `as_function` needs to take and give back pytrees. Value
    facts (shapes, dtypes, bytes, sources) are read from `program`."""

    program: Program
    ops: list[Op]
    outvars: list[ValueId | Const]
    in_tree: Any
    out_tree: Any
    donated: frozenset[int] = frozenset()  # flat input positions donated

    @property
    def invars(self) -> list[ValueId]:
        return self.program.invars

    def new_id(self, like: ValueId) -> ValueId:
        """A fresh value with the same shape, dtype, bytes and source as `like`."""
        p = self.program
        return p.new_value(p.shapes[like], p.dtypes[like], p.nbytes[like], p.avals[like], RECOMPUTED, p.sources[like])

    def with_ops(self, ops: list[Op], outvars: list[ValueId | Const]) -> "Graph":
        """A graph of the same program with other ops and outputs."""
        return Graph(self.program, ops, outvars, self.in_tree, self.out_tree, self.donated)


def trace(fn: Callable, *args: Any, donate_argnums: int | tuple[int, ...] = ()) -> Graph:
    """Trace `fn(*args)` into a `Graph`: the front end's program (`jaxpr_adapter.inline`),
    ready to be rewritten.

    Args:
        fn: a JAX-traceable function.
        *args: example arguments (arrays or pytrees of arrays; only shapes and dtypes matter).
        donate_argnums: positional arguments whose buffers the caller donates.

    Returns:
        The graph, with call-like primitives inlined.
    """
    traced = ja.trace(fn, args, donate_argnums=donate_argnums)
    p = ja.inline(traced.closed_jaxpr)
    return Graph(p, list(p.ops), list(p.outvars), traced.in_tree, traced.out_tree, frozenset(traced.donated))


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
    p = graph.program
    for (path, leaf), vid in zip(with_paths, graph.invars):
        shape = tuple(getattr(leaf, "shape", ()))
        dtype = getattr(leaf, "dtype", None)
        if shape != tuple(p.shapes[vid]) or (dtype is not None and str(dtype) != p.dtypes[vid]):
            raise PlanError(f"argument args{jax.tree_util.keystr(path)[:120]} is "
                            f"{dtype or type(leaf).__name__}{list(shape)} where fit traced {p.dtypes[vid]}{list(p.shapes[vid])}")
    return leaves


def run(graph: Graph, flat_args: list[Any]) -> list[Any]:
    """Evaluate the graph on flat arguments, one `bind` per op; works under tracing too."""
    env: dict[int, Any] = dict(zip(graph.invars, flat_args))

    def read(v: int | Const) -> Any:
        return v.value if isinstance(v, Const) else env[v]

    _run_ops(graph.ops, env)
    return [read(v) for v in graph.outvars]


def _run_ops(ops: Any, env: dict[int, Any]) -> None:
    def read(v: int | Const) -> Any:
        return v.value if isinstance(v, Const) else env[v]

    for op in ops:
        invals = [read(v) for v in op.operands]
        if op.eqn is None:
            outvals = _run_group(op, invals, env)
        else:
            outvals = ja.bind(op.eqn, invals)
        for vid, val in zip(op.outputs, outvals):
            if vid is not None:
                env[vid] = val


def _run_group(group: Op, invals: list[Any], env: dict[int, Any]) -> list[Any]:
    """Run a recompute group so that XLA keeps it a separate computation.

    "barrier": the operands pass through `optimization_barrier`, as `jax.checkpoint` does.
    XLA:CPU removes barriers early in its pipeline and a later CSE pass then merges the copy
    with the original (measured: jax.checkpoint saves nothing there), so on CPU the group is the
    taken branch of a `cond` whose predicate is always true but not provably so to XLA, read
    from the anchor. XLA does not CSE across computations, and the cond cannot run before the
    anchor exists. (Identical branches do not work: XLA hoists code common to all branches
    out of the cond, and CSE merges it back.)
    """
    # Later rewrites may rename the group's operands; its body keeps reading the ids it
    # was built with, bound here by position. Anything else it reads comes from the caller's env.
    ids = group.body_ins
    made = {vid for n in group.body for vid in n.outputs}
    consts = {vid: env[vid] for n in group.body for vid in n.inputs if vid not in ids and vid not in made}

    def body(*operands: Any) -> list[Any]:
        inner = dict(consts)
        inner.update(zip(ids, operands))
        _run_ops(group.body, inner)
        inner.update((out, inner[src]) for out, src in group.through)
        return [inner[v] if v is not None else None for v in group.outputs]

    if group.guard == "barrier":
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
