"""Adam in plain JAX (no optax): the optimizer the example training steps update with.

The state is a plain pytree `{"step": int32[], "mu": params-like, "nu": params-like}`, so the
two moments are as large as the parameters, as in every real Adam training step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def adam_init(params: Any) -> dict[str, Any]:
    """Zero moments and a zero step count for `params`.

    >>> state = adam_init({"w": jnp.ones((2, 3))})
    >>> state["mu"]["w"].shape, int(state["step"])
    ((2, 3), 0)

    Args:
        params: any pytree of float arrays.

    Returns:
        `{"step": int32 scalar, "mu": zeros like params, "nu": zeros like params}`.
    """
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"step": jnp.zeros((), jnp.int32), "mu": zeros, "nu": jax.tree_util.tree_map(jnp.zeros_like, params)}


def adam_state_midrun(params: Any, *, step: int = 1000, grad_scale: float = 1e-3) -> dict[str, Any]:
    """An Adam state as it stands well into training: the step count past warm-up and a second
    moment that has seen gradients of about `grad_scale`; the first moment starts at zero.

    The bundled training steps start from this rather than from `adam_init`. From zero moments,
    Adam's first update is `lr * g / (|g| + eps)`, a sign function of the gradient: an element
    whose gradient is rounding noise (a bias that softmax ignores, say) moves by up to `lr` in
    either direction, so two correct executions of the same step disagree by up to `lr` on it.
    Mid-run, the second moment bounds that sensitivity, as it does in real training.

    >>> state = adam_state_midrun({"w": jnp.ones((2, 3))})
    >>> int(state["step"]), round(float(state["nu"]["w"][0, 0]), 12), float(state["mu"]["w"].sum())
    (1000, 1e-06, 0.0)

    Args:
        params: any pytree of float arrays.
        step: the step count the state has reached.
        grad_scale: typical gradient magnitude the second moment has accumulated.

    Returns:
        `{"step": int32 scalar, "mu": zeros like params, "nu": grad_scale**2 like params}`.
    """
    nu = jax.tree_util.tree_map(lambda p: jnp.full_like(p, grad_scale * grad_scale), params)
    mu = jax.tree_util.tree_map(jnp.zeros_like, params)
    return {"step": jnp.asarray(step, jnp.int32), "mu": mu, "nu": nu}


def adam_update(
    params: Any,
    grads: Any,
    state: dict[str, Any],
    *,
    lr: float = 1e-3,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> tuple[Any, dict[str, Any]]:
    """One bias-corrected Adam (AdamW when `weight_decay` > 0) step.

    >>> params = {"w": jnp.ones(3)}
    >>> new, state = adam_update(params, {"w": jnp.ones(3)}, adam_init(params), lr=0.1)
    >>> round(float(new["w"][0]), 4), int(state["step"])
    (0.9, 1)

    Args:
        params: the current parameters.
        grads: gradients, same structure as `params`.
        state: from `adam_init` or a previous `adam_update`.

    Returns:
        `(new_params, new_state)`.
    """
    step = state["step"] + 1
    t = step.astype(jnp.float32)
    mu = jax.tree_util.tree_map(lambda m, g: b1 * m + (1.0 - b1) * g, state["mu"], grads)
    nu = jax.tree_util.tree_map(lambda v, g: b2 * v + (1.0 - b2) * (g * g), state["nu"], grads)
    c1 = 1.0 - b1**t
    c2 = 1.0 - b2**t

    def apply(p, m, v):
        update = (m / c1) / (jnp.sqrt(v / c2) + eps)
        if weight_decay:
            update = update + weight_decay * p
        return p - lr * update

    new_params = jax.tree_util.tree_map(apply, params, mu, nu)
    return new_params, {"step": step, "mu": mu, "nu": nu}
