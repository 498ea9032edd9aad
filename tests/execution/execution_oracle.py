"""Test helpers: run every equation of a function through its numpy rule and through JAX itself.

The truth is JAX: each equation's inputs are the values JAX computed for the equations before
it, and the rule's output must equal `primitive.bind` on the same inputs.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from jaxmem.compiler.jaxpr_adapter import inline, trace
from jaxmem.compiler.plan_types import Const
from jaxmem.execution.primitives import jax_kernel, kernel_for
from jaxmem.execution.tracing import const_array, host_inputs


def assert_close(got: Any, want: Any, what: str, rtol: float = 1e-5) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    g, w = got.astype(np.float64), want.astype(np.float64)
    finite = np.abs(w[np.isfinite(w)])
    scale = float(finite.max()) if finite.size else 1.0
    np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale + 1e-30, equal_nan=True, err_msg=what)


def check_equations(fn: Callable[..., Any], *args: Any, rtol: float = 1e-5) -> dict[str, int]:
    """Compare each equation's numpy kernel with JAX on JAX's own intermediate values.

    Returns how many equations of each primitive were checked against a numpy rule (those that
    fall back to JAX are counted under "jax:<name>").
    """
    traced = trace(fn, args)
    prog = inline(traced.closed_jaxpr)
    values: list[Any] = [None] * len(prog.avals)
    for v, x in zip(prog.invars, host_inputs(args, traced.in_avals)):
        values[v] = x
    counts: dict[str, int] = {}
    for fe in prog.ops:
        ins = [const_array(v.value, v.aval) if isinstance(v, Const) else values[v] for v in fe.operands]
        truth = jax_kernel(fe.eqn).compute(*ins)
        truth = truth if len(fe.outputs) != 1 else (truth,)
        kernel = kernel_for(fe.eqn)
        name = fe.eqn.primitive.name
        if kernel.name == "numpy":
            got = kernel.compute(*ins)
            got = got if len(fe.outputs) != 1 else (got,)
            for j, (g, t) in enumerate(zip(got, truth)):
                assert_close(g, t, f"{name} output {j} (compute)", rtol)
            if kernel.into is not None and len(fe.outputs) == 1:
                out = np.empty_like(np.asarray(truth[0]))
                out[...] = np.array(-1).astype(out.dtype)  # garbage the kernel must overwrite
                kernel.into(out, *ins)
                assert_close(out, truth[0], f"{name} (into)", rtol)
            counts[name] = counts.get(name, 0) + 1
        else:
            counts["jax:" + name] = counts.get("jax:" + name, 0) + 1
        for o, t in zip(fe.outputs, truth):
            if o is not None:
                values[o] = np.asarray(t)
    return counts


def max_rel_error(got: Any, want: Any) -> float:
    """Largest error over the output leaves, relative to each leaf's largest magnitude."""
    worst = 0.0
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.size == 0:
            continue
        scale = max(float(np.max(np.abs(b))), 1e-30)
        worst = max(worst, float(np.max(np.abs(a - b))) / scale)
    return worst


def matches_jit(ours: Any, jitted: Any, rtol: float = 1e-5) -> list[str]:
    """Problems, if any: a float leaf must be within `rtol` of jax.jit's, relative to the leaf's
    largest magnitude (the output's scale); integers and booleans exactly equal."""
    problems = []
    for i, (a, b) in enumerate(zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(jitted))):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            problems.append(f"leaf {i}: {a.dtype}{list(a.shape)} against jax.jit's {b.dtype}{list(b.shape)}")
        elif a.dtype.kind in "biu":
            if not np.array_equal(a, b):
                problems.append(f"leaf {i}: integers differ")
        elif a.size:
            scale = max(float(np.max(np.abs(b.astype(np.float64)))), 1e-30)
            err = float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) / scale
            if not err <= rtol:
                problems.append(f"leaf {i}: {err:.2e} of the output's scale from jax.jit")
    return problems
