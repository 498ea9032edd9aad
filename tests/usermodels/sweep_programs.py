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


def tiled_scale():
    """`jnp.tile` (a primitive of its own in newer JAX) read by one multiply: XLA computes the
    tiled rows inside the multiply's loop fusion, never storing them."""
    row = jnp.ones((1, 4096))
    w = jnp.ones((2048, 4096))
    return (lambda row, w: jnp.sum(jnp.tile(row, (2048, 1)) * w, axis=0)), (row, w)


def stacked_layers():
    """Per-layer updates stacked (`jnp.stack`, a primitive in newer JAX) and unstacked back."""
    xs = jnp.ones((8, 512, 512))

    def fn(xs):
        parts = jnp.unstack(xs)
        ys = jnp.stack([jnp.tanh(p) * (i + 1) for i, p in enumerate(parts)])
        # a cond whose branches keep different residuals pads them with `empty2`
        branch = jax.grad(lambda v: jax.lax.cond(v.sum() > 0, jnp.sin, lambda v: v * 2, v).sum())
        return ys, jnp.searchsorted(jnp.arange(16.0), ys[0, 0]), branch(ys[1, 1])

    return fn, (xs,)


def int4_quantize():
    """Values quantized to int4 inside the step, returned and read back."""
    x = jnp.linspace(-7, 7, 64 * 512).reshape(64, 512)

    def fn(x):
        q = jnp.round(x).astype(jnp.int4)
        return q, (q.astype(jnp.float32) * 0.5).sum(0)

    return fn, (x,)


def jitted_donated_sgd(batch: int = 256):
    """An SGD step the user already wrapped in `jax.jit(..., donate_argnums=1)`: the batch
    first, the weights (two leaves) second."""
    w = {"a": jnp.ones((1024, 1024)), "b": jnp.ones((1024,))}
    x = jnp.ones((batch, 1024))

    def step(x, w):
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w["a"] + w["b"])))(w)
        return jax.tree.map(lambda p, d: p - 0.1 * d, w, g)

    return jax.jit(step, donate_argnums=1), (x, w)


def function_leaf():
    """A model pytree holding its activation function as a leaf (as equinox's eqx.nn.MLP does),
    passed to a step that `jax.jit` cannot take it into."""

    class Wrapped:  # a multi-line repr, as eqx.filter_jit's wrapper has
        def __init__(self, f):
            self.f = f

        def __call__(self, *a):
            return self.f(*a)

        def __repr__(self):
            return "Wrapped(\n  f=step\n)"

    model = {"w": jnp.ones((8, 8)), "activation": jax.nn.relu}
    return Wrapped(lambda m, x: m["activation"](x @ m["w"])), (model, jnp.ones((2, 8)))
