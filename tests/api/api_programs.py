"""Small programs the API tests analyse: arguments as `jax.ShapeDtypeStruct`s (the factory runs
no program, so nothing of it stays on a TPU and the command line and the API see the same)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sgd_step(w, x):
    loss = lambda w: jnp.sum(jnp.tanh(x @ w["a"]) @ w["b"])  # noqa: E731
    return jax.tree.map(lambda p, g: p - 0.1 * g, w, jax.grad(loss)(w))


def weights(d: int = 256):
    return {"a": jax.ShapeDtypeStruct((d, 4 * d), jnp.float32), "b": jax.ShapeDtypeStruct((4 * d, d), jnp.float32)}


def abstract_sgd():
    return sgd_step, (weights(), jax.ShapeDtypeStruct((32, 256), jnp.float32))


def abstract_jitted_sgd():
    return jax.jit(sgd_step, donate_argnums=0), (weights(512), jax.ShapeDtypeStruct((64, 512), jnp.float32))
