"""What the remat tests share: an SGD training step around a loss, and the value check."""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np


def sgd_step(loss: Callable[..., Any], lr: float = 0.1) -> Callable[..., Any]:
    """One SGD step of `loss(params, *batch)`: returns (loss value, updated params)."""

    def step(params, *batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        return value, jax.tree.map(lambda p, g: p - lr * g, params, grads)

    return step


def assert_close(a: Any, b: Any) -> None:
    """Every leaf of `b` within 1e-5 of the largest magnitude of `a`'s (float32, as the executor)."""
    for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        p, q = np.asarray(p), np.asarray(q)
        assert float(np.max(np.abs(p - q))) <= 1e-5 * max(float(np.max(np.abs(p))), 1e-30)
