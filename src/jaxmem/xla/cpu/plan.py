"""`jaxmem.plan`: the compiler's plan of a function with XLA:CPU's own figures for it beside it.

The compiler plans without XLA (it sits on a floor below `xla/`, docs/architecture.md); the
public `jaxmem.plan` is that plan with `compiled.memory_analysis()` for the same call in
`Plan.xla`, so that every report can show both.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler import planner
from jaxmem.compiler.plan_types import Plan, XlaReference
from jaxmem.xla.cpu.compile import xla_reference


def plan(
    fn: Callable,
    *args: Any,
    donate_argnums: int | Sequence[int] = (),
    xla: bool = True,
    **kwargs: Any,
) -> Plan:
    """Trace `fn(*args, **kwargs)` and plan its memory, with XLA's figures for it in `Plan.xla`.

    >>> import jax, jax.numpy as jnp
    >>> def step(w, x):
    ...     return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
    >>> params, batch = jnp.ones((64, 64)), jnp.ones((8, 64))
    >>> p = plan(step, params, batch, donate_argnums=(0,))
    >>> p.peak_bytes, p.lower_bound_bytes, p.xla.total_bytes
    (36864, 36864, 36864)

    **Arguments:** `fn` and its example `args` (pytrees of arrays); `donate_argnums`, positional
    arguments whose buffers outputs may take over; `xla`, also compile with XLA here and record
    its `memory_analysis()` in `Plan.xla` (False: `compiler.planner.plan`'s plan alone);
    keyword arguments are passed to `fn` (closed over).

    **Returns:** a checked `Plan` (`plan.valid` is the checker's verdict).
    """
    if isinstance(donate_argnums, int):
        donate_argnums = (donate_argnums,)
    donate_argnums = tuple(donate_argnums)
    result = planner.plan(fn, *args, donate_argnums=donate_argnums, **kwargs)
    if not xla:
        return result
    return dataclasses.replace(result, xla=_xla_reference(fn, args, donate_argnums, kwargs))


def _xla_reference(fn: Callable, args: Sequence[Any], donate_argnums: tuple[int, ...],
                   kwargs: dict[str, Any]) -> XlaReference:
    # The same split as the planner's tracing: array keywords are inputs, anything else is static.
    dynamic, static = ja.split_kwargs(kwargs)
    target = functools.partial(fn, **static) if static else fn
    return xla_reference(target, args, donate_argnums=donate_argnums, kwargs=dynamic)


__all__ = ["plan"]
