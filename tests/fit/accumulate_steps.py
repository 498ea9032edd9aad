"""Training steps for gradient accumulation: the batch passed to the gradient call (as a
positional argument, under a keyword, with an aux output), and a loss that closes over it.
`jaxmem fit` pastes its answer into this file's text in the tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp

LAYERS, WIDTH, BATCH = 8, 256, 4096


def loss_fn(params, x, y):
    h = x
    for w in params:
        h = jnp.tanh(h @ w)
    return jnp.mean((h - y) ** 2)


def step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    return loss, [w - 0.1 * g for w, g in zip(params, grads)]


def loss_with_aux(params, batch, scale=1.0):
    out = jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"]
    loss = jnp.mean((out - batch["y"]) ** 2) * scale
    return loss, {"mean_out": jnp.mean(out), "positives": jnp.sum(batch["y"] > 0)}


def step_aux(params, key, batch):
    (loss, aux), grads = jax.value_and_grad(loss_with_aux, has_aux=True)(params, batch=batch, scale=2.0)
    return loss, aux, jax.tree.map(lambda w, g: w - 0.1 * g, params, grads), key


def step_lambda(params, x, y):
    grads = jax.grad(lambda p: loss_fn(p, x, y))(params)
    return [w - 0.1 * g for w, g in zip(params, grads)]


def step_closed(params, x, y):
    def loss(params):
        return loss_fn(params, x, y)

    grads = jax.grad(loss)(params)
    return [w - 0.1 * g for w, g in zip(params, grads)]


def step_unclear(params, x, table):
    """The loss reads two arrays of different leading dimensions, one each: which is the batch?"""
    def loss(params):
        return loss_fn(params, x, table[: x.shape[0]])

    grads = jax.grad(loss)(params)
    return [w - 0.1 * g for w, g in zip(params, grads)]


def data(batch: int = BATCH):
    k = jax.random.split(jax.random.key(0), LAYERS + 2)
    params = [jax.random.normal(k[i], (WIDTH, WIDTH)) * WIDTH ** -0.5 for i in range(LAYERS)]
    return params, jax.random.normal(k[-2], (batch, WIDTH)), jax.random.normal(k[-1], (batch, WIDTH))


def make():
    params, x, y = data()
    return step, (params, x, y)


def make_closed(which: str = "step_closed"):
    params, x, y = data()
    return globals()[which], (params, x, y)


def make_unclear():
    params, x, y = data()
    return step_unclear, (params, x, jax.numpy.concatenate([y, y]))
