"""A GRU language-model-style regressor over a sequence with `lax.scan`, forward and gradient.

    >>> fn, args = make_loss_and_grad(batch=2, seq=3, in_dim=4, hidden=5)
    >>> loss, grads = fn(*args)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.examples.layers import dense_init


def init_params(*, in_dim: int, hidden: int, seed: int = 0) -> dict[str, jax.Array]:
    """GRU weights (update, reset and candidate gates stacked) and a linear readout to `in_dim`.

    >>> init_params(in_dim=4, hidden=5)["w_x"].shape
    (4, 15)
    """
    rng = np.random.default_rng(seed)
    return {
        "w_x": dense_init(rng, in_dim, 3 * hidden),
        "w_h": dense_init(rng, hidden, 3 * hidden),
        "b": jnp.zeros((3 * hidden,), jnp.float32),
        "w_out": dense_init(rng, hidden, in_dim),
        "b_out": jnp.zeros((in_dim,), jnp.float32),
    }


def gru_cell(params: dict[str, jax.Array], h: jax.Array, x: jax.Array) -> jax.Array:
    """One GRU step: h (batch, hidden), x (batch, in_dim) -> the next h."""
    hidden = h.shape[-1]
    gx = x @ params["w_x"] + params["b"]
    gh = h @ params["w_h"]
    z = jax.nn.sigmoid(gx[:, :hidden] + gh[:, :hidden])
    r = jax.nn.sigmoid(gx[:, hidden:2 * hidden] + gh[:, hidden:2 * hidden])
    n = jnp.tanh(gx[:, 2 * hidden:] + r * gh[:, 2 * hidden:])
    return (1.0 - z) * n + z * h


def loss_fn(params: dict[str, jax.Array], xs: jax.Array, ys: jax.Array) -> jax.Array:
    """Mean squared error of next-step predictions; xs, ys: (seq, batch, in_dim), time-major."""
    h0 = jnp.zeros((xs.shape[1], params["w_h"].shape[0]), xs.dtype)

    def step(h, x):
        h = gru_cell(params, h, x)
        return h, h @ params["w_out"] + params["b_out"]

    _, preds = jax.lax.scan(step, h0, xs)
    return jnp.mean(jnp.square(preds - ys))


def make_loss_and_grad(*, batch: int = 64, seq: int = 64, in_dim: int = 128, hidden: int = 512,
                       seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`fn(params, xs, ys) -> (loss, grads)` through a `lax.scan` GRU, and its arguments.

    >>> fn, (params, xs, ys) = make_loss_and_grad(batch=2, seq=3, in_dim=4, hidden=5)
    >>> xs.shape
    (3, 2, 4)
    """
    params = init_params(in_dim=in_dim, hidden=hidden, seed=seed)
    rng = np.random.default_rng(seed + 1)
    stream = rng.standard_normal((seq + 1, batch, in_dim), dtype=np.float32)

    def rnn_loss_and_grad(params, xs, ys):
        return jax.value_and_grad(loss_fn)(params, xs, ys)

    return rnn_loss_and_grad, (params, jnp.asarray(stream[:-1]), jnp.asarray(stream[1:]))
