"""A small convolutional classifier in plain JAX (`lax.conv_general_dilated`, `lax.reduce_window`
pooling), as a forward pass and as an Adam training step.

    >>> fn, args = make_train_step(batch=2, size=8, channels=(4, 8), classes=3)
    >>> params, opt_state, loss = fn(*args)
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.examples.adam import adam_state_midrun, adam_update
from jaxmem.examples.layers import dense_init, one_hot_cross_entropy

_DIMS = ("NHWC", "HWIO", "NHWC")


def init_params(*, in_channels: int, channels: tuple[int, ...], classes: int, size: int,
                seed: int = 0) -> dict[str, Any]:
    """3x3 conv kernels (HWIO) for each stage, then a dense head on the pooled features.

    >>> p = init_params(in_channels=3, channels=(4, 8), classes=2, size=8)
    >>> [c["w"].shape for c in p["convs"]], p["head"]["w"].shape
    ([(3, 3, 3, 4), (3, 3, 4, 8)], (8, 2))
    """
    rng = np.random.default_rng(seed)
    convs = []
    cin = in_channels
    for cout in channels:
        w = rng.standard_normal((3, 3, cin, cout), dtype=np.float32) / math.sqrt(9 * cin)
        convs.append({"w": jnp.asarray(w), "b": jnp.zeros((cout,), jnp.float32)})
        cin = cout
    return {"convs": convs, "head": {"w": dense_init(rng, cin, classes), "b": jnp.zeros((classes,), jnp.float32)}}


def max_pool(x: jax.Array) -> jax.Array:
    """2x2 max pooling, stride 2, NHWC (`reduce_window` with max; its gradient is select_and_scatter_add)."""
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def avg_pool(x: jax.Array) -> jax.Array:
    """2x2 average pooling, stride 2, NHWC (`reduce_window` with add)."""
    return jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") * 0.25


def forward(params: dict[str, Any], images: jax.Array) -> jax.Array:
    """Logits of NHWC images: conv-relu-pool per stage (max pool, then average pool on the last
    stage), global mean, dense head.

    >>> p = init_params(in_channels=3, channels=(4, 8), classes=2, size=8)
    >>> forward(p, jnp.ones((1, 8, 8, 3))).shape
    (1, 2)
    """
    x = images
    last = len(params["convs"]) - 1
    for i, conv in enumerate(params["convs"]):
        x = jax.lax.conv_general_dilated(x, conv["w"], (1, 1), "SAME", dimension_numbers=_DIMS)
        x = jax.nn.relu(x + conv["b"])
        x = avg_pool(x) if i == last else max_pool(x)
    x = jnp.mean(x, axis=(1, 2))
    return x @ params["head"]["w"] + params["head"]["b"]


def make_data(*, batch: int, size: int, in_channels: int, classes: int, seed: int = 1) -> dict[str, jax.Array]:
    """Random NHWC float32 images and int32 labels."""
    rng = np.random.default_rng(seed)
    return {"images": jnp.asarray(rng.standard_normal((batch, size, size, in_channels), dtype=np.float32)),
            "labels": jnp.asarray(rng.integers(0, classes, size=(batch,), dtype=np.int32))}


def make_forward(*, batch: int = 32, size: int = 64, in_channels: int = 3, channels: tuple[int, ...] = (32, 64, 128),
                 classes: int = 100, seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The CNN's class probabilities as a function of `(params, images)`.

    >>> fn, args = make_forward(batch=1, size=8, channels=(4,), classes=3)
    >>> fn(*args).shape
    (1, 3)
    """
    params = init_params(in_channels=in_channels, channels=channels, classes=classes, size=size, seed=seed)
    images = make_data(batch=batch, size=size, in_channels=in_channels, classes=classes, seed=seed + 1)["images"]

    def cnn_forward(params, images):
        return jax.nn.softmax(forward(params, images), axis=-1)

    return cnn_forward, (params, images)


def make_train_step(*, batch: int = 32, size: int = 64, in_channels: int = 3,
                    channels: tuple[int, ...] = (32, 64, 128), classes: int = 100, lr: float = 1e-3,
                    seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A CNN training step with Adam: `fn(params, opt_state, data) -> (params, opt_state, loss)`.

    >>> fn, args = make_train_step(batch=1, size=8, channels=(4,), classes=3)
    >>> int(fn(*args)[1]["step"])
    1001
    """
    params = init_params(in_channels=in_channels, channels=channels, classes=classes, size=size, seed=seed)
    data = make_data(batch=batch, size=size, in_channels=in_channels, classes=classes, seed=seed + 1)

    def loss_fn(params, data):
        return one_hot_cross_entropy(forward(params, data["images"]), data["labels"])

    def cnn_train_step(params, opt_state, data):
        loss, grads = jax.value_and_grad(loss_fn)(params, data)
        params, opt_state = adam_update(params, grads, opt_state, lr=lr)
        return params, opt_state, loss

    return cnn_train_step, (params, adam_state_midrun(params), data)
