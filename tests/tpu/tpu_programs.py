"""Small programs for the TPU tests, loadable by a child process as `tpu_programs:NAME` from
this folder (`tests/tpu/tpu_programs.py:NAME`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

MiB = 1 << 20


def rows_step(rows: int = 4):
    """A step over `rows` MiB-rows of float32 state (each row 1024 x 256 f32 = 1 MiB, tiled
    exactly on a TPU): state -> state * 0.5 + 1 and its sum, the state donated."""
    def step(state):
        return state * 0.5 + 1.0, jnp.sum(state)

    return jax.jit(step, donate_argnums=0), (jax.ShapeDtypeStruct((rows * 1024, 256), jnp.float32),)


def over_hbm():
    """An elementwise step over 20 GiB: more than a v5e's HBM."""
    def step(x):
        return jnp.sin(x) * 2.0

    return step, (jax.ShapeDtypeStruct((20 * 1024, 256 * 1024), jnp.float32),)


def narrow_columns():
    """Arrays a TPU pads: f32[4096, 3] takes 4096 x 128 x 4 B in its tiled layout."""
    def step(x, w):
        return jnp.tanh(x @ w), x * 2.0

    return step, (jax.ShapeDtypeStruct((4096, 3), jnp.float32), jax.ShapeDtypeStruct((3, 5), jnp.float32))
