"""The MLP training step of `mlp.make_train_step` (relu, Adam) written by hand to hold as little
as it can on the device: every hidden activation goes to pinned host memory as it is made and
comes back just before the backward pass reads it, and `optimization_barrier`s fix the order
XLA's scheduler would otherwise choose (it fetches every offloaded value at the start of the
backward pass, and leaves every optimizer update to the end).

The order, per layer of the backward pass: fetch the layer's output and take the relu's
gradient; fetch its input; the weight gradient, and Adam's moments from it; the gradient
reaching the layer below; then the layer's new weights, once nothing reads the old ones. At
each weight-gradient GEMM the device holds its two operands and its result and nothing else
of size, which is the host-offload lower bound's figure for this step (`fitting.bound`,
`lower_bound(host_offload=True)`).

A measured witness for the offloaded orders fit and `jaxmem optimize` build themselves
(`fitting.reorder`, `ordered_function(offload=True)`): on H100 this step is 60.43 MiB, theirs
60.45, against a half-temp budget of 60.42 (docs/design/fit.md, "Orders with values held in host
memory"; `benchmarks/bench_offload_by_hand.py`).

    >>> fn, args = make_train_step(depth=1, width=8, in_dim=4, classes=3, batch=2)
    >>> int(fn(*args)[1]["step"])
    1001
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxmem.examples.adam import adam_state_midrun
from jaxmem.examples.mlp import init_params, make_data

B1, B2, EPS = 0.9, 0.999, 1e-8   # as `adam.adam_update`'s defaults


def make_train_step(*, depth: int = 4, width: int = 1024, in_dim: int = 784, classes: int = 10,
                    batch: int = 1024, lr: float = 1e-3, seed: int = 0,
                    offload: bool = True) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`(fn, (params, opt_state, data))` with the same arguments and results as
    `mlp.make_train_step(..., activation="relu")`; `offload=False` keeps the activations on the
    device (the same order otherwise)."""
    params = init_params(depth=depth, width=width, in_dim=in_dim, classes=classes, seed=seed)
    data = make_data(batch=batch, in_dim=in_dim, classes=classes, seed=seed + 1)

    def to_host(x: jax.Array) -> jax.Array:
        return jax.device_put(x, jax.memory.Space.Host) if offload else x

    def to_device(x: jax.Array) -> jax.Array:
        return jax.device_put(x, jax.memory.Space.Device) if offload else x

    def offloaded_train_step(params, opt_state, data):
        x, y = data["x"], data["y"]
        t = (opt_state["step"] + 1).astype(jnp.float32)
        saved = []
        h = x
        for layer in params[:-1]:
            h = jax.nn.relu(h @ layer["w"] + layer["b"])
            saved.append(to_host(h))
            # the copy out now, not when the backward pass asks for it
            h, _ = lax.optimization_barrier((h, saved[-1]))
        logp = jax.nn.log_softmax(h @ params[-1]["w"] + params[-1]["b"], axis=-1)
        onehot = jax.nn.one_hot(y, classes, dtype=logp.dtype)
        loss = -jnp.mean(jnp.sum(onehot * logp, axis=-1))
        g = (jnp.exp(logp) - onehot) / x.shape[0]
        g, _ = lax.optimization_barrier((g, loss))   # the loss now: its logits die here
        new_p: list[dict[str, Any]] = [{} for _ in params]
        new_m: list[dict[str, Any]] = [{} for _ in params]
        new_v: list[dict[str, Any]] = [{} for _ in params]

        def moments(i: int, gw: jax.Array, gb: jax.Array) -> None:
            for k, gk in (("w", gw), ("b", gb)):
                new_m[i][k] = B1 * opt_state["mu"][i][k] + (1.0 - B1) * gk
                new_v[i][k] = B2 * opt_state["nu"][i][k] + (1.0 - B2) * (gk * gk)

        def new_params(i: int, after: jax.Array) -> None:
            # the old weights are overwritten (donated) only once `after` has read them
            _, old = lax.optimization_barrier((after, params[i]))
            for k in ("w", "b"):
                step = (new_m[i][k] / (1.0 - B1 ** t)) / (jnp.sqrt(new_v[i][k] / (1.0 - B2 ** t)) + EPS)
                new_p[i][k] = old[k] - lr * step

        head = len(params) - 1
        moments(head, h.T @ g, g.sum(0))
        g, _ = lax.optimization_barrier((g, new_m[head]["w"]))
        dh = g @ params[head]["w"].T
        new_params(head, dh)
        dh, _ = lax.optimization_barrier((dh, new_p[head]))
        for i in range(head - 1, -1, -1):
            out, dh = lax.optimization_barrier((saved[i], dh))
            gl = jnp.where(to_device(out) > 0, dh, 0.0)
            if i > 0:
                inp, gl = lax.optimization_barrier((saved[i - 1], gl))
                inp = to_device(inp)
            else:
                inp = x
            moments(i, inp.T @ gl, gl.sum(0))
            if i == 0:
                new_params(i, gl)
                break
            gl, _ = lax.optimization_barrier((gl, (new_m[i], new_v[i])))
            dh = gl @ params[i]["w"].T
            new_params(i, dh)
            dh, _ = lax.optimization_barrier((dh, new_p[i]["w"]))
        return new_p, {"step": opt_state["step"] + 1, "mu": new_m, "nu": new_v}, loss

    return offloaded_train_step, (params, adam_state_midrun(params), data)
