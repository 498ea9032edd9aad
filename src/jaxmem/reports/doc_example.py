"""The plan the reports' docstring examples share: one SGD step.

    >>> plan = sgd_step_plan()
    >>> plan.peak_bytes > 0, len(plan.invars)
    (True, 2)
"""

from __future__ import annotations

from jaxmem.compiler.plan_types import Plan


def sgd_step_plan() -> Plan:
    """`jaxmem.plan` of one SGD step: `w` (f32[64, 64]) is updated and returned, `x` (f32[8, 64])
    only read."""
    import jax
    import jax.numpy as jnp

    from jaxmem.xla.cpu.plan import plan

    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)

    return plan(step, jnp.ones((64, 64)), jnp.ones((8, 64)))
