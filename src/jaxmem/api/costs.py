"""What a framework adds to a step over the same step written pure, and the change that removes it.

A framework's step holds, at its peak on the device, buffers the same step written as a pure
`jax.jit` with its state donated would not:

- **state not donated**: outputs that replace the model's and optimizer's state (the pool pairs
  them as a training loop feeds them back) while the arguments they replace are still held;
- **unchanged state copied out**: outputs that are an input as it came in (NNX's `nnx.jit`
  returns every Variable it was handed), a fresh buffer each where not donated.

Each is given in bytes and by source line (the user's line whose operation made the output; the
arrays by name where they are copies). Each change the framework offers against them
(`Step.changes()`: donation, returning only what changed) is compiled for the same device and run
through the same pool, and, where the arguments hold values on this host, both steps run on its
CPU from copies of them, to check that the change gives the same results.

    found = framework_costs(run)     # {"framework", "adds", "changes", ...}, or None
"""

from __future__ import annotations

import time
from typing import Any, Callable

from jaxmem.errors import JaxmemError, PlanError

# The largest arguments a results check runs on this host's CPU (twice: the step and the change).
RESULTS_CHECK_BYTES = 1 << 30
# A change lowers the pool's peak only by more than this share of it (and 1 MiB): less is the
# noise of XLA's own choices between two programs.
NOISE_SHARE = 0.005


def wanted(run: Any) -> bool:
    """Whether to look: always for a framework's step, for plain JAX where asked (`costs`)."""
    step, mode = run.program.step, getattr(run.args, "costs", "auto")
    if step is None or mode in (False, "off", "no"):
        return False
    return mode in (True, "on", "yes") or step.framework != "jax"


def framework_costs(run: Any, figures: Callable[[Any], tuple[dict[str, int], dict[str, Any] | None]]) -> dict[str, Any] | None:
    """The costs the step's framework adds and the changes that remove them, as plain JSON
    values; None where not wanted. `figures(program)` is XLA's figures and the pool's verdict
    for a changed program on the run's device (`pipeline.figures_of`)."""
    if not wanted(run):
        return None
    from jaxmem.api.program import program_of_step

    step, program = run.program.step, run.program
    started = time.perf_counter()
    adds = costs_found(program)
    before = _pool_peak(run.pool)
    changes = []
    for change in step.changes():
        row: dict[str, Any] = {"title": change.title, "code": change.code}
        try:
            changed = program_of_step(change.build)
            xla, pool = figures(changed)
        except JaxmemError as err:   # the change does not compile here: say so, keep the rest
            row.update({"error": str(err)})
            changes.append(row)
            continue
        after = _pool_peak(pool)
        row.update({"xla": xla, "pool_peak_bytes": after,
                    "saved_bytes": (before - after) if before is not None and after is not None else None,
                    "xla_saved_bytes": _xla_total(run) - xla["total_bytes"] if _xla_total(run) is not None else None})
        row["lowers_peak"] = row["saved_bytes"] is not None and row["saved_bytes"] > max(1 << 20, NOISE_SHARE * before)
        row["same_results"], row["results_note"] = same_results(step, changed.step)
        changes.append(row)
    kept = [c for c in changes if c.get("lowers_peak") and c.get("same_results") is not False]
    best = max(kept, key=lambda c: c["saved_bytes"], default=None)
    return {"pool_peak_bytes": before, "adds": adds, "changes": changes,
            "pure_pool_peak_bytes": best["pool_peak_bytes"] if best else before,
            "added_bytes": best["saved_bytes"] if best else 0, "seconds": round(time.perf_counter() - started, 3)}


def _pool_peak(pool: Any) -> int | None:
    if pool is None:
        return None
    peak = pool.get("peak_bytes") if isinstance(pool, dict) else getattr(pool, "peak_bytes", None)
    return int(peak) if peak is not None else None


def _xla_total(run: Any) -> int | None:
    for ref in (run.tpu, run.gpu, getattr(run.plan, "xla", None)):
        if ref is not None:
            return int(ref.total_bytes)
    return None


def costs_found(program: Any) -> list[dict[str, Any]]:
    """The outputs the step holds beside the state they replace (not donated), by the user's
    line that made them, and the outputs that are inputs copied out unchanged, by name."""
    from jaxmem.compiler.jaxpr_adapter import aval_bytes, output_origins
    from jaxmem.reports.analysis import _argument_names
    from jaxmem.runtime.steps import Leaf, match_state

    origins = output_origins(program.closed_jaxpr)
    ins, outs = program.in_leaves(), program.out_leaves()
    names = _argument_names(program.args, program.names)
    key = lambda leaf: f"{leaf.dtype}{list(leaf.shape)}"  # noqa: E731
    arguments = [Leaf(aval_bytes(leaf), donated=program.donated[i]) for i, leaf in enumerate(ins)]
    outputs = match_state(arguments, [Leaf(aval_bytes(o)) for o in outs], [key(x) for x in ins], [key(o) for o in outs])
    copied: list[dict[str, Any]] = []
    by_line: dict[str, dict[str, Any]] = {}
    for j, (origin, out) in enumerate(zip(origins, outputs)):
        if origin.passed_input is not None and not program.donated[origin.passed_input]:
            copied.append({"array": names[origin.passed_input] if origin.passed_input < len(names) else f"input {origin.passed_input}",
                           "bytes": origin.nbytes})
        elif out.state_of is not None and not program.donated[out.state_of]:
            where = str(origin.source) if origin.source is not None else "(no line: a constant)"
            line = by_line.setdefault(where, {"source": where, "bytes": 0, "arrays": 0})
            line["bytes"] += origin.nbytes
            line["arrays"] += 1
    lines = sorted(by_line.values(), key=lambda r: -r["bytes"])
    return [
        {"what": "state not donated", "bytes": sum(r["bytes"] for r in lines), "arrays": sum(r["arrays"] for r in lines),
         "why": "outputs that replace the model's and optimizer's state are made while the state they replace is "
                "still held", "lines": lines},
        {"what": "unchanged state copied out", "bytes": sum(r["bytes"] for r in copied), "arrays": len(copied),
         "why": "outputs that are an input as it came in: a copy each, where the input is not donated",
         "copies": sorted(copied, key=lambda r: -r["bytes"])},
    ]


def same_results(step: Any, changed: Any, limit: int = RESULTS_CHECK_BYTES) -> tuple[bool | None, str]:
    """Whether the changed step gives the same results as the step (its outputs and the state it
    leaves), both run on this host's CPU from copies of the user's arguments; None and why where
    they cannot be run here."""
    import jax
    import numpy as np

    from jaxmem.frameworks.step import has_values

    if step.runner is None or changed.runner is None or step.clone is None or changed.clone is None:
        return None, "not run: the step cannot be called here as the user calls it"
    if not has_values((step.user_args, step.user_kwargs)):
        return None, "not run: the arguments are jax.ShapeDtypeStructs (no values)"
    away = [d for d in step.devices if getattr(d, "platform", "cpu") != "cpu"]
    if away:
        return None, f"not run: the arguments live on {away[0]}, and jaxmem runs its checks on this host's CPU"
    nbytes = sum(int(getattr(x, "nbytes", 0)) for x in jax.tree.leaves((step.user_args, step.user_kwargs)))
    if nbytes > limit:
        return None, f"not run: the arguments hold {nbytes / 2**30:.1f} GiB, above the {limit / 2**30:.0f} GiB it runs here"
    try:
        if _shares_arrays(step):
            return None, "not run: the arguments could not be copied apart from yours (a donating run would consume them)"
        first = _run(step)
        second = _run(changed)
    except Exception as err:  # the user's own step failed to run here: no verdict, and why
        from jaxmem.frameworks.step import one_line

        return None, f"not run: {one_line(err, 200)}"
    a, b = [_values(x) for x in _arrays(first)], [_values(x) for x in _arrays(second)]
    if len(a) != len(b):
        return False, f"the change leaves {len(b)} arrays where the step leaves {len(a)}"
    differ = [k for k, (x, y) in enumerate(zip(a, b)) if not np.array_equal(x, y, equal_nan=True)]
    if differ:
        return False, f"{len(differ)} of {len(a)} arrays differ"
    return True, f"{len(a)} arrays equal, run on this host's CPU"


def _arrays(tree: Any) -> list[Any]:
    """The array leaves of a run's results (a module's functions and other static fields are
    the same objects in both runs)."""
    import jax
    import numpy as np

    return [x for x in jax.tree.leaves(tree) if isinstance(x, (jax.Array, np.ndarray, np.generic))]


def _values(leaf: Any) -> Any:
    """A result leaf as a numpy array (a typed PRNG key as its key data)."""
    import jax
    import numpy as np

    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    return np.asarray(leaf)


def _shares_arrays(step: Any) -> bool:
    """Whether `step.clone` hands back any array of the user's own (never run a donating step on it)."""
    import jax

    own = {id(x) for x in jax.tree.leaves((step.user_args, step.user_kwargs)) if isinstance(x, jax.Array)}
    copy = step.clone((step.user_args, step.user_kwargs))
    return any(id(x) in own for x in jax.tree.leaves(copy) if isinstance(x, jax.Array))


def _run(step: Any) -> Any:
    """The step run once as the user runs it, on copies of their arguments: its results."""
    args, kwargs = step.clone((step.user_args, step.user_kwargs))
    out = step.runner(*args, **kwargs)
    return step.results(out, args)


def check_costs_mode(mode: Any) -> Any:
    """`costs=` as `jaxmem.analyze` takes it: "auto", True or False."""
    if mode not in ("auto", True, False):
        raise PlanError(f"costs must be 'auto', True or False, got {mode!r}")
    return mode
