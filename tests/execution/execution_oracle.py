"""Test helpers: run every equation of a function through its numpy rule and through JAX itself.

The truth is JAX: each equation's inputs are the values JAX computed for the equations before
it, and the rule's output must equal `primitive.bind` on the same inputs.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from jaxmem.execution.primitives import jax_kernel, kernel_for
from jaxmem.execution.tracing import host_inputs, inline, trace_flat


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
    traced = trace_flat(fn, args)
    prog = inline(traced.closed_jaxpr)
    values: list[Any] = [None] * len(prog.avals)
    for v, x in zip(prog.invars, host_inputs(args, traced.in_avals)):
        values[v] = x
    counts: dict[str, int] = {}
    for fe in prog.eqns:
        ins = [values[op] if isinstance(op, int) else op for op in fe.operands]
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


def float64_truth(fn: Callable[..., Any], args: Any) -> Any:
    """`fn` run by jax.jit in float64 on the float32 arguments widened: the exact answer to within
    float64 rounding, against which both jax.jit and jaxmem are measured."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    try:
        wide = jax.tree_util.tree_map(
            lambda x: np.asarray(x, np.float64) if np.asarray(x).dtype == np.float32 else x, args)
        return jax.tree_util.tree_map(np.asarray, jax.jit(fn)(*wide))
    finally:
        jax.config.update("jax_enable_x64", previous)


def accuracy_report(ours: Any, jitted: Any, truth: Any) -> list[dict[str, float]]:
    """Per float leaf: error against jax.jit, and each one's error against the float64 truth,
    all relative to the leaf's largest magnitude."""
    rows = []
    for a, b, t in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(jitted),
                       jax.tree_util.tree_leaves(truth)):
        a, b, t = np.asarray(a), np.asarray(b), np.asarray(t)
        if a.dtype.kind in "biu" or a.size == 0:
            rows.append({"exact": bool(np.array_equal(a, b)), "vs_jit": 0.0, "ours": 0.0, "jit": 0.0})
            continue
        scale = max(float(np.max(np.abs(b))), 1e-30)
        a64, b64, t64 = (x.astype(np.float64) for x in (a, b, t))
        rows.append({"exact": True, "vs_jit": float(np.max(np.abs(a64 - b64))) / scale,
                     "ours": float(np.max(np.abs(a64 - t64))) / scale, "jit": float(np.max(np.abs(b64 - t64))) / scale})
    return rows


def matches_jit(ours: Any, jitted: Any, truth: Any | None = None, rtol: float = 1e-5, factor: float = 5.0) -> list[str]:
    """Problems, if any. A float leaf must be within `rtol` of jax.jit's (relative to its scale);
    integers exact. Given the float64 `truth`, a leaf that misses `rtol` passes when it is no
    farther from the exact answer than `factor` times jax.jit's own error on that leaf, or than
    jax.jit's worst error on any output of the program: such a leaf is ill-conditioned (an Adam
    update of a gradient that is pure rounding noise), where float32 results of any two
    executions disagree by about as much as each disagrees with the exact answer."""
    problems = []
    rows = accuracy_report(ours, jitted, truth if truth is not None else jitted)
    worst_jit = max((r["jit"] for r in rows), default=0.0)
    for i, r in enumerate(rows):
        if not r["exact"]:
            problems.append(f"leaf {i}: integers differ")
        elif r["vs_jit"] > rtol and (truth is None or r["ours"] > max(rtol, factor * r["jit"], worst_jit)):
            problems.append(f"leaf {i}: {r['vs_jit']:.2e} from jax.jit; from float64: ours {r['ours']:.2e}, "
                            f"jax.jit {r['jit']:.2e} (its worst leaf {worst_jit:.2e})")
    return problems
