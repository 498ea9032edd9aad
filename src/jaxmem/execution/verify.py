"""Check a plan by running it, and measure the same program op by op under each allocator.

`jaxmem analyze --execute` prints what these two return.

    >>> import jax, jax.numpy as jnp, numpy as np, jaxmem
    >>> def fn(w, x):   # one SGD step
    ...     return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> args = (np.ones((64, 64), np.float32), np.ones((8, 64), np.float32))
    >>> p = jaxmem.plan(fn, *args)
    >>> compare_with_jit(fn, args, p)["ok"]
    True
    >>> [row["allocator"] for row in eager_summaries(fn, args, "h100-80gb")]
    ['bfc', 'bfc-growth', 'platform']
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.plan_types import Plan
from jaxmem.compiler.rules import rule
from jaxmem.errors import PlanError
from jaxmem.execution.eager import run_eager
from jaxmem.execution.jit import build
from jaxmem.compiler.jaxpr_adapter import inline, trace
from jaxmem.units import parse_size

# Unit roundoff per float dtype, and the dtype its sums accumulate in: XLA accumulates half
# precision dots and reductions in float32, and so does the executor.
_EPS = {"float64": 2.0 ** -52, "float32": 2.0 ** -23, "float16": 2.0 ** -10, "bfloat16": 2.0 ** -7}
_ACCUMULATOR = {"float16": "float32", "bfloat16": "float32"}
# The equality test against jax.jit accepts, relative to an output's largest magnitude, a few
# roundings of the output's own dtype plus the growth of rounding error in the longest sum the
# program makes (about sqrt(K) roundings for K terms summed in a different order), and never
# less than a multiple of JAX's own disagreement with itself (op by op against jax.jit).
_ROUNDINGS, _SUM_ROUNDINGS, _NOISE_MULTIPLE = 4.0, 8.0, 4.0
_INTEGER_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"})

# Allocator modes of `eager_summaries`: name, registry allocator, preallocate.
MODES: tuple[tuple[str, str, bool], ...] = (
    ("bfc", "bfc", True), ("bfc-growth", "bfc-growth", False), ("platform", "platform", False),
)


def leaf_errors(actual: Any, expected: Any) -> list[dict[str, Any]]:
    """Per output leaf: absolute and relative (to the expected leaf's largest magnitude) error.

    Integer and boolean leaves must match exactly (their error is the count of differing
    elements); shapes and dtypes must match (else `PlanError`).
    """
    got, want = jax.tree_util.tree_leaves(actual), jax.tree_util.tree_leaves(expected)
    if len(got) != len(want):
        raise PlanError(f"{len(got)} outputs where jax.jit gives {len(want)}")
    rows = []
    for a, b in zip(got, want):
        if jax.dtypes.issubdtype(getattr(b, "dtype", None), jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            raise PlanError(f"output {a.dtype}{list(a.shape)} where jax.jit gives {b.dtype}{list(b.shape)}")
        if a.size == 0:
            rows.append({"dtype": str(b.dtype), "abs": 0.0, "rel": 0.0, "exact": True})
            continue
        if a.dtype.kind in "biu":
            wrong = int(np.count_nonzero(a != b))
            rows.append({"dtype": str(b.dtype), "abs": float(wrong), "rel": float(wrong), "exact": wrong == 0})
            continue
        a64, b64 = a.astype(np.complex128 if a.dtype.kind == "c" else np.float64), b.astype(
            np.complex128 if b.dtype.kind == "c" else np.float64)
        same_nan = np.isnan(a64) & np.isnan(b64)
        diff = np.where(same_nan, 0.0, np.abs(a64 - b64))
        diff = np.where(np.isnan(diff), np.inf, diff)  # NaN on one side only
        finite = np.abs(b64[np.isfinite(b64)])
        scale = float(finite.max()) if finite.size else 1.0
        err = float(diff.max())
        rows.append({"dtype": str(b.dtype), "abs": err, "rel": err / scale if scale > 0 else err,
                     "exact": err == 0.0})
    return rows


def dtype_tolerance(dtype: str, reduction: int) -> float:
    """Relative error an output of `dtype` may carry when its longest sum has `reduction` terms.

    >>> f"{dtype_tolerance('float32', 4096):.1e}", f"{dtype_tolerance('bfloat16', 1):.3f}"
    ('6.2e-05', '0.031')
    """
    eps = _EPS.get(dtype, _EPS["float32"])
    acc = _EPS[_ACCUMULATOR.get(dtype, dtype)] if dtype in _EPS else eps
    return _ROUNDINGS * eps + _SUM_ROUNDINGS * acc * math.sqrt(max(1, reduction))


def _reduced_terms(eqn: Any) -> int:
    """How many terms the longest sum of one equation adds (1 where it adds none)."""
    name, params = ja.eqn_name(eqn), ja.eqn_params(eqn)
    shape = lambda i: ja.eqn_in_shapes(eqn)[i]  # noqa: E731
    if name == "dot_general":
        (contract, _), _ = params["dimension_numbers"]
        return math.prod(shape(0)[d] for d in contract)
    if name == "conv_general_dilated":
        spec = params["dimension_numbers"]
        kernel = shape(1)
        return math.prod(kernel) // max(1, kernel[spec.rhs_spec[0]]) if spec is not None else math.prod(kernel[1:])
    if name.startswith("reduce_") or name in ("argmax", "argmin"):
        axes = params.get("axes", ())
        return math.prod(shape(0)[a] for a in axes) if axes else 1
    if rule(name).running_sum:
        return shape(0)[params["axis"]]
    if name == "scan":
        return int(params["length"])  # a carry summed across iterations is one more long sum
    return 1


def longest_reduction(closed_jaxpr: Any) -> int:
    """The most terms any one sum of the program adds, nested bodies included.

    >>> longest_reduction(jax.make_jaxpr(lambda a, b: (a @ b).sum())(np.ones((4, 96)), np.ones((96, 3))))
    96
    """
    return max([1] + [_reduced_terms(eqn) for eqn in ja.walk_eqns(closed_jaxpr)])


def _tolerance(row: dict[str, Any], reduction: int, noise: float | None) -> float | None:
    """The relative error accepted for one output leaf; None for integers and booleans (exact)."""
    if row["dtype"] in _INTEGER_DTYPES:
        return None
    tol = dtype_tolerance(row["dtype"], reduction)
    return tol if noise is None else max(tol, _NOISE_MULTIPLE * noise)


def _within(row: dict[str, Any], tol: float | None) -> bool:
    return row["exact"] if tol is None else row["rel"] <= tol


def _best_seconds(call: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def op_by_op(fn: Callable[..., Any], args: Sequence[Any]) -> Any:
    """`fn(*args)` as JAX runs it op by op (`jax.disable_jit`): the same program rounded after
    every primitive instead of inside XLA's fusions."""
    with jax.disable_jit():
        return jax.block_until_ready(fn(*args))


def compare_with_jit(fn: Callable[..., Any], args: Sequence[Any], plan: Plan,
                     donate_argnums: Sequence[int] = (), *, repeat: int = 1) -> dict[str, Any]:
    """Run `plan` in an arena of exactly its size and compare with `jax.jit(fn)(*args)`.

    Equality is judged per output leaf against a tolerance that follows its dtype and the longest
    sum in the program (`dtype_tolerance`); integers and booleans must match exactly. Only when a
    float leaf is outside it is JAX run op by op as well: the error JAX makes against itself is
    then the noise floor, and a leaf within a few times that floor is equal too.

    **Arguments:** `fn` and `args` as planned; `plan`, from `jaxmem.plan(fn, *args, ...)`;
    `donate_argnums`, as planned; `repeat`, timed runs after the first (the best is kept).

    **Returns:** `{ok, max_abs_err, max_rel_err, tolerance, reduction, noise_rel, seconds,
    jax_jit_seconds, leaves, worst_leaf}`. `worst_leaf` is the output whose relative error is the
    largest share of its tolerance, and `max_rel_err`/`tolerance` are that leaf's (`tolerance` is
    None when it is an integer leaf); `reduction`, the longest sum's terms; `noise_rel`, JAX op by
    op against `jax.jit` on that leaf, or None when it was not needed. Timings are of warm calls.
    """
    reduction = longest_reduction(ja.make_closed_jaxpr(fn, *args))
    executable = build(fn, args, donate_argnums, plan=plan)
    executable.run(args)
    ours = None

    def run_ours() -> None:
        nonlocal ours
        ours = executable.run(args)

    seconds = _best_seconds(run_ours, max(1, repeat))
    jitted = jax.jit(fn)
    reference = jax.block_until_ready(jitted(*args))
    jax_seconds = _best_seconds(lambda: jax.block_until_ready(jitted(*args)), max(1, repeat))
    rows = leaf_errors(ours, reference)
    tols = [_tolerance(r, reduction, None) for r in rows]
    noise: list[float | None] = [None] * len(rows)
    if not all(_within(r, t) for r, t in zip(rows, tols)):
        noise = [n["rel"] for n in leaf_errors(op_by_op(fn, args), reference)]
        tols = [_tolerance(r, reduction, n) for r, n in zip(rows, noise)]
    share = [r["rel"] / t if t else (0.0 if r["exact"] else float("inf")) for r, t in zip(rows, tols)]
    worst = int(np.argmax(share)) if share else -1
    return {
        "ok": all(_within(r, t) for r, t in zip(rows, tols)),
        "max_abs_err": max((r["abs"] for r in rows), default=0.0),
        "max_rel_err": rows[worst]["rel"] if rows else 0.0,
        "tolerance": tols[worst] if rows else None,
        "reduction": reduction,
        "noise_rel": noise[worst] if rows else None,
        "seconds": seconds,
        "jax_jit_seconds": jax_seconds,
        "leaves": len(rows),
        "worst_leaf": worst,
    }


def eager_summaries(fn: Callable[..., Any], args: Sequence[Any], capacity: int | str) -> list[dict[str, Any]]:
    """Run `fn` op by op on a simulated device of `capacity` under each allocator mode.

    **Arguments:** `fn`, `args`; `capacity`, bytes, "16GiB" or a preset name ("h100-80gb").

    **Returns:** one dict per mode ("bfc" preallocated, "bfc-growth", "platform") with
    `allocator, peak_bytes_in_use, peak_pool_bytes, largest_free_block_bytes,
    fragmentation_at_peak, num_allocs, device_allocs, fits`. The largest free block and the
    fragmentation are read when bytes in use peaked; `fits` is False when the run ran out of
    memory (the figures then describe the run up to that point). Only allocations are simulated:
    an op-by-op run asks for the same sizes in the same order whatever the values.
    """
    from jaxmem.runtime.device import Device

    capacity = parse_size(capacity)
    prog = inline(trace(fn, args).closed_jaxpr)
    rows = []
    for name, allocator, preallocate in MODES:
        device = Device(capacity, backend="simulated", allocator=allocator, preallocate=preallocate)
        _, state, oom = run_eager(prog, None, device, compute=False)
        peak = state.at_peak or state.stats
        rows.append({
            "allocator": name,
            "peak_bytes_in_use": int(state.stats["peak_bytes_in_use"]),
            "peak_pool_bytes": int(state.stats["peak_pool_bytes"]),
            "largest_free_block_bytes": int(peak["largest_free_block_bytes"]),
            "fragmentation_at_peak": float(peak["fragmentation"]),
            "num_allocs": int(state.allocs),
            "device_allocs": int(getattr(device.allocator, "device_allocs", 0)),
            "fits": oom is None,
        })
    return rows
