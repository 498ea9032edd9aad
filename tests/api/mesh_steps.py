"""Sharded factories for `jaxmem.maxbatch` on a mesh: a scanned MLP stack under FSDP over an
`AbstractMesh` of 8 chips, its batch sharded over `data`. Imported by the tests and by the child
that checks the answer with JAX's own AOT compile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

LAYERS, D, F, S = 8, 2048, 8192, 1024
SPECS = {"w1": P(None, "data", None), "w2": P(None, "data", None), "x": P("data", None, None)}


def step(params, x):
    def loss(params):
        def layer(h, w):
            return h + jax.nn.gelu(h @ w[0]) @ w[1], None
        h, _ = jax.lax.scan(layer, x, (params["w1"], params["w2"]))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda a, b: a - 1e-3 * b, params, grads)


def structs(batch_size: int, mesh):
    def sds(shape, name):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, SPECS[name]))

    params = {"w1": sds((LAYERS, D, F), "w1"), "w2": sds((LAYERS, F, D), "w2")}
    return params, sds((batch_size, S, D), "x")


def make(batch_size: int):
    mesh = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    return jax.jit(step, donate_argnums=0), structs(batch_size, mesh)


def make160():
    """The step at a global batch of 160: XLA:TPU refuses its per-chip program (`jaxmem fit` on a mesh)."""
    return make(160)


def step_batch_passed(params, x):
    """`step` with the batch an argument of the gradient call (what gradient accumulation splits)."""
    def loss(params, x):
        def layer(h, w):
            return h + jax.nn.gelu(h @ w[0]) @ w[1], None
        h, _ = jax.lax.scan(layer, x, (params["w1"], params["w2"]))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda a, b: a - 1e-3 * b, params, grads)


def make_batch_passed(batch_size: int = 160):
    mesh = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    return jax.jit(step_batch_passed, donate_argnums=0), structs(batch_size, mesh)
