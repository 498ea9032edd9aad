"""A multilayer perceptron classifier in plain JAX: forward pass and Adam training step.

    >>> fn, args = make_train_step(depth=2, width=16, in_dim=8, classes=4, batch=2)
    >>> params, opt_state, loss = fn(*args)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.examples.adam import adam_state_midrun, adam_update
from jaxmem.examples.layers import dense_init, one_hot_cross_entropy


def init_params(*, depth: int, width: int, in_dim: int, classes: int, seed: int = 0) -> list[dict[str, jax.Array]]:
    """`depth` hidden layers of `width` units, then a `classes`-way output layer.

    >>> [p["w"].shape for p in init_params(depth=1, width=5, in_dim=3, classes=2)]
    [(3, 5), (5, 2)]
    """
    rng = np.random.default_rng(seed)
    dims = [in_dim] + [width] * depth + [classes]
    return [{"w": dense_init(rng, a, b), "b": jnp.zeros((b,), jnp.float32)} for a, b in zip(dims[:-1], dims[1:])]


def forward(params: list[dict[str, jax.Array]], x: jax.Array, activation: str = "relu") -> jax.Array:
    """Logits of x: (batch, in_dim); `activation` is "relu", "gelu" or "silu" for the hidden layers.

    >>> forward(init_params(depth=1, width=5, in_dim=3, classes=2), jnp.ones((4, 3))).shape
    (4, 2)
    """
    act = {"relu": jax.nn.relu, "gelu": jax.nn.gelu, "silu": jax.nn.silu}[activation]
    for layer in params[:-1]:
        x = act(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def make_data(*, batch: int, in_dim: int, classes: int, seed: int = 1) -> dict[str, jax.Array]:
    """Random float32 inputs (batch, in_dim) and int32 labels (batch,)."""
    rng = np.random.default_rng(seed)
    return {"x": jnp.asarray(rng.standard_normal((batch, in_dim), dtype=np.float32)),
            "y": jnp.asarray(rng.integers(0, classes, size=(batch,), dtype=np.int32))}


def make_forward(*, depth: int = 4, width: int = 2048, in_dim: int = 1024, classes: int = 1000,
                 batch: int = 512, activation: str = "gelu",
                 seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The MLP's logits as a function of `(params, x)`.

    >>> fn, args = make_forward(depth=1, width=8, in_dim=4, classes=3, batch=2)
    >>> fn(*args).shape
    (2, 3)
    """
    params = init_params(depth=depth, width=width, in_dim=in_dim, classes=classes, seed=seed)
    x = make_data(batch=batch, in_dim=in_dim, classes=classes, seed=seed + 1)["x"]

    def mlp_forward(params, x):
        return jax.nn.softmax(forward(params, x, activation), axis=-1)

    return mlp_forward, (params, x)


def make_train_step(*, depth: int = 4, width: int = 2048, in_dim: int = 1024, classes: int = 1000,
                    batch: int = 512, activation: str = "relu", lr: float = 1e-3,
                    seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """An MLP training step with Adam: `fn(params, opt_state, data) -> (params, opt_state, loss)`.

    >>> fn, args = make_train_step(depth=1, width=8, in_dim=4, classes=3, batch=2)
    >>> int(fn(*args)[1]["step"])
    1001

    Args:
        depth, width, in_dim, classes: the network's shape.
        batch: examples per step.
        activation: hidden activation ("relu", "gelu", "silu").
        lr: Adam's learning rate.
        seed: weights seed (data uses seed + 1).

    Returns:
        `(fn, (params, opt_state, data))`.
    """
    params = init_params(depth=depth, width=width, in_dim=in_dim, classes=classes, seed=seed)
    data = make_data(batch=batch, in_dim=in_dim, classes=classes, seed=seed + 1)

    def loss_fn(params, data):
        return one_hot_cross_entropy(forward(params, data["x"], activation), data["y"])

    def mlp_train_step(params, opt_state, data):
        loss, grads = jax.value_and_grad(loss_fn)(params, data)
        params, opt_state = adam_update(params, grads, opt_state, lr=lr)
        return params, opt_state, loss

    return mlp_train_step, (params, adam_state_midrun(params), data)
