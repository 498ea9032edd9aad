"""`jaxmem.plan`: jaxmem's plan of a plain JAX function's memory, XLA:CPU's figures beside it
(`xla/cpu/plan.py`), never of a program the function's framework would not run.

    p = jaxmem.plan(step, params, batch, donate_argnums=(0,))
    p.peak_bytes, p.xla.total_bytes

A framework's step (`nnx.jit`, a plain function taking Flax NNX objects, `eqx.filter_jit`, a
Keras model) is one line pointing to `jaxmem.analyze`, which reads it as the framework compiles
it; a plain function that updates its arguments in place, or leaves a traced value in a global,
is refused as `jaxmem.analyze` refuses it.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jaxmem.errors import PlanError


def plan(fn: Callable[..., Any], *args: Any, donate_argnums: int | Sequence[int] = (), xla: bool = True,
         **kwargs: Any) -> Any:
    """Trace `fn(*args, **kwargs)` and plan its memory, with XLA's figures for it in `Plan.xla`
    (`xla.cpu.plan.plan`, which documents every argument).

    **Raises:** `PlanError`, one line: `fn` is a framework's step (use `jaxmem.analyze`), updates
    its arguments in place, leaves a traced value outside its outputs, or fails to trace.
    """
    from jaxmem.frameworks import as_step, framework_of
    from jaxmem.frameworks.step import FRAMEWORK_NAMES
    from jaxmem.xla.cpu.plan import plan as plan_on_cpu

    kind = framework_of(fn, args, kwargs)
    if kind != "jax":
        raise PlanError(f"jaxmem.plan plans plain JAX functions; for a {FRAMEWORK_NAMES[kind]} step use "
                        "jaxmem.analyze, which reads it as the framework compiles it")
    try:
        as_step(fn, args, kwargs)   # the refusals: in-place updates jax.jit drops, leaked tracers
    except PlanError:
        raise
    except Exception:  # a function that fails to trace: the planner's own trace says so, in one line
        pass
    return plan_on_cpu(fn, *args, donate_argnums=donate_argnums, xla=xla, **kwargs)
