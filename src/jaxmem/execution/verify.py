"""Check a plan by running it, and measure the same program op by op under each allocator.

`jaxmem analyze --execute` prints what these two return.

    >>> fn, args = jaxmem.examples.suite.PROGRAMS["mlp_train"].factory()
    >>> p = jaxmem.plan(fn, *args)
    >>> compare_with_jit(fn, args, p)["ok"]
    True
    >>> [row["allocator"] for row in eager_summaries(fn, args, "h100-80gb")]
    ['bfc', 'bfc-growth', 'platform']
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from jaxmem.compiler.plan_types import Plan
from jaxmem.errors import PlanError
from jaxmem.execution.eager import run_eager
from jaxmem.execution.jit import build
from jaxmem.compiler.jaxpr_adapter import inline, trace
from jaxmem.units import parse_size

# Relative error (against the output's largest magnitude) accepted per float dtype.
TOLERANCE = {"float64": 1e-5, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

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


def _within(row: dict[str, Any]) -> bool:
    if row["dtype"] in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"):
        return row["exact"]
    return row["rel"] <= TOLERANCE.get(row["dtype"], 1e-5)


def _best_seconds(call: Callable[[], Any], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    return best


def compare_with_jit(fn: Callable[..., Any], args: Sequence[Any], plan: Plan,
                     donate_argnums: Sequence[int] = (), *, repeat: int = 1) -> dict[str, Any]:
    """Run `plan` in an arena of exactly its size and compare with `jax.jit(fn)(*args)`.

    **Arguments:** `fn` and `args` as planned; `plan`, from `jaxmem.plan(fn, *args, ...)`;
    `donate_argnums`, as planned; `repeat`, timed runs after the first (the best is kept).

    **Returns:** `{ok, max_abs_err, max_rel_err, seconds, jax_jit_seconds}` plus `leaves` (the
    number of outputs) and `worst_leaf` (index of the output with the largest relative error).
    `ok`: float outputs within 1e-5 of the output's largest magnitude (float32/float64), integers
    and booleans exact. Timings are of warm calls (after one call that compiles).
    """
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
    rel = [r["rel"] for r in rows]
    return {
        "ok": all(_within(r) for r in rows),
        "max_abs_err": max((r["abs"] for r in rows), default=0.0),
        "max_rel_err": max(rel, default=0.0),
        "seconds": seconds,
        "jax_jit_seconds": jax_seconds,
        "leaves": len(rows),
        "worst_leaf": int(np.argmax(rel)) if rel else -1,
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
