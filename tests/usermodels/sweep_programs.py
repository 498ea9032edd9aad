"""Small programs for features users reach for outside jaxmem's suite (typed PRNG keys, packed
sub-byte dtypes, primitives newer JAX emits), loaded by file as XLA:GPU's child loads them."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def typed_key_dropout():
    """A step that splits a new-style typed key (key<fry>) and draws a dropout mask with it."""
    key = jax.random.key(0)
    w = jax.random.normal(jax.random.key(1), (256, 512))
    x = jnp.ones((64, 256))

    def step(w, key, x):
        key, sub = jax.random.split(key)
        h = jax.nn.relu(x @ w)
        keep = jax.random.bernoulli(sub, 0.9, h.shape)
        return jnp.where(keep, h / 0.9, 0.0).sum(), key

    return step, (w, key, x)


def int4_weights():
    """An int4 weight (XLA stores two to a byte) dequantized into a bfloat16 matmul."""
    w4 = jax.random.randint(jax.random.key(0), (512, 512), -7, 7).astype(jnp.int4)
    x = jnp.ones((64, 512), jnp.bfloat16)
    return (lambda w4, x: x @ w4.astype(jnp.bfloat16)), (w4, x)
