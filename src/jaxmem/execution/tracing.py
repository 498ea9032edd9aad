"""Trace a function for execution, flatten its arguments, and inline its call-like equations.

Shared by `jit` (which hands the traced jaxpr to the planner), `eager` (which runs the inlined
equations one by one) and `verify`.

    >>> traced = trace_flat(lambda x, y: {"s": x + y}, (np.ones(2, np.float32), 1.0), ())
    >>> traced.out_tree, [str(a.dtype) for a in traced.in_avals]
    (PyTreeDef({'s': *}), ['float32', 'float32'])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.errors import PlanError
from jaxmem.execution.primitives import is_key_dtype, key_impl, storage


@dataclass
class Traced:
    """One traced call: the ClosedJaxpr, the pytree structures, and which flat inputs are donated."""

    closed_jaxpr: Any
    in_tree: Any
    out_tree: Any
    in_avals: list[Any]
    donated: tuple[int, ...]


def signature(args: Sequence[Any]) -> tuple[Any, ...]:
    """The cache key of a call: the pytree structure and each leaf's shape, dtype and weakness.

    >>> signature((np.ones((2, 3), np.float32),))[1]
    (((2, 3), 'float32', False),)
    """
    leaves, tree = jax.tree_util.tree_flatten(tuple(args))
    sig = []
    for leaf in leaves:
        if isinstance(leaf, (bool, int, float, complex)):
            sig.append(((), type(leaf).__name__, True))  # Python scalars trace as weak types
            continue
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            leaf = np.asarray(leaf)
            dtype = leaf.dtype
        sig.append((tuple(np.shape(leaf)), str(dtype), bool(getattr(leaf, "weak_type", False))))
    return tree, tuple(sig)


def donated_leaves(args: Sequence[Any], donate_argnums: Sequence[int]) -> tuple[int, ...]:
    """Flat leaf indices of the positional arguments in `donate_argnums`."""
    counts = ja.flat_arg_counts(args)
    for i in donate_argnums:
        if not isinstance(i, int) or not -len(counts) <= i < len(counts):
            raise PlanError(f"donate_argnums entry {i!r} is not a positional argument index (the function got {len(counts)})")
    donate = {i % len(counts) for i in donate_argnums} if counts else set()
    flat, start = [], 0
    for i, n in enumerate(counts):
        if i in donate:
            flat.extend(range(start, start + n))
        start += n
    return tuple(flat)


def trace_flat(fn: Callable[..., Any], args: Sequence[Any], donate_argnums: Sequence[int] = ()) -> Traced:
    """Trace `fn(*args)` with `jax.make_jaxpr` and keep the input and output pytree structures."""
    if not callable(fn):
        raise PlanError(f"expected a function to run, got {type(fn).__name__}")
    try:
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
    except TypeError as err:
        raise PlanError(f"cannot trace {getattr(fn, '__name__', fn)!r} with these arguments: {err}") from None
    in_tree = jax.tree_util.tree_structure(tuple(args))
    out_tree = jax.tree_util.tree_structure(shapes)
    in_avals = [v.aval for v in closed.jaxpr.invars]
    return Traced(closed, in_tree, out_tree, in_avals, donated_leaves(args, donate_argnums))


def host_inputs(args: Sequence[Any], in_avals: Sequence[Any]) -> list[np.ndarray]:
    """The flat arguments as numpy arrays of their traced dtypes (keys as their raw data)."""
    leaves = jax.tree_util.tree_leaves(tuple(args))
    if len(leaves) != len(in_avals):
        raise PlanError(f"expected {len(in_avals)} array arguments, got {len(leaves)}")
    out = []
    for leaf, aval in zip(leaves, in_avals):
        if is_key_dtype(aval.dtype):
            out.append(np.asarray(jax.random.key_data(leaf)))
            continue
        dtype, shape = storage(aval)
        arr = np.asarray(leaf)
        if arr.dtype != dtype:
            arr = arr.astype(dtype)
        if arr.shape != shape:
            raise PlanError(f"argument of shape {arr.shape} where the trace had {shape}")
        out.append(arr)
    return out


def to_user(value: np.ndarray, aval: Any) -> Any:
    """An output as the user gets it: a numpy array, or a typed key array for PRNG keys."""
    if is_key_dtype(aval.dtype):
        return jax.random.wrap_key_data(value, impl=key_impl(aval.dtype))
    return value


def const_array(value: Any, aval: Any) -> np.ndarray:
    """A literal or closed-over constant as a numpy array of the aval's storage dtype."""
    if is_key_dtype(aval.dtype):
        return np.asarray(jax.random.key_data(value))
    dtype, shape = storage(aval)
    arr = np.asarray(value, dtype=dtype)
    if arr.shape != shape:
        arr = np.broadcast_to(arr, shape)
    return arr


@dataclass
class FlatEqn:
    """One equation that runs, its operands and outputs renamed to dense value indices.

    Operand entries are an int (a value) or a numpy array (a literal or constant).
    """

    eqn: Any
    operands: list[Any]
    outputs: list[int | None]


@dataclass
class FlatProgram:
    """A jaxpr with call-like equations inlined: what eager mode runs op by op."""

    eqns: list[FlatEqn]
    avals: list[Any]               # aval of each value index
    invars: list[int]
    outvars: list[Any]             # value index or numpy array (a literal output)


def inline(closed_jaxpr: Any) -> FlatProgram:
    """Inline pjit/closed_call/custom_jvp/custom_vjp/remat bodies, as op-by-op JAX runs them.

    Constants stay numpy arrays (not values); scan, while and cond stay single equations.
    """
    jaxpr, consts = ja.split_closed(closed_jaxpr)
    prog = FlatProgram([], [], [], [])
    env: dict[Any, Any] = {}

    def new(var: Any) -> int:
        prog.avals.append(var.aval)
        return len(prog.avals) - 1

    def read(env: dict[Any, Any], atom: Any) -> Any:
        if ja.is_literal(atom):
            return const_array(ja.literal_value(atom), atom.aval)
        return env[atom]

    def walk(jaxpr: Any, env: dict[Any, Any]) -> None:
        for eqn in jaxpr.eqns:
            operands = [read(env, a) for a in eqn.invars]
            body = ja.call_body(eqn)
            if body is not None:
                inner, inner_consts = body
                sub: dict[Any, Any] = {}
                for var, c in zip(inner.constvars, inner_consts):
                    sub[var] = const_array(c, var.aval)
                for var, op in zip(inner.invars, operands):
                    sub[var] = op
                walk(inner, sub)
                for var, atom in zip(eqn.outvars, inner.outvars):
                    if not ja.is_dropvar(var):
                        env[var] = read(sub, atom)
                continue
            outputs: list[int | None] = []
            for var in eqn.outvars:
                if ja.is_dropvar(var):
                    outputs.append(None)
                else:
                    env[var] = new(var)
                    outputs.append(env[var])
            prog.eqns.append(FlatEqn(eqn, operands, outputs))

    for var, c in zip(jaxpr.constvars, consts):
        env[var] = const_array(c, var.aval)
    for var in jaxpr.invars:
        env[var] = new(var)
        prog.invars.append(env[var])
    walk(jaxpr, env)
    prog.outvars = [read(env, a) for a in jaxpr.outvars]
    return prog
