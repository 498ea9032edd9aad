"""A step on 64 GPUs (8 nodes of 8): FSDP over `data`, tensor parallel over `model`, scanned
layers. Imported by the test and by the child that compiles it with JAX alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

LAYERS, D, F = 4, 4096, 16384
SPECS = {"w1": P(None, "data", "model"), "w2": P(None, "model", "data"), "x": P("data", None, None)}


def step(params, x):
    def loss(params):
        def layer(h, w):
            return h + jax.nn.gelu(h @ w[0]) @ w[1], None
        h, _ = jax.lax.scan(layer, x, (params["w1"], params["w2"]))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda a, b: a - 1e-3 * b, params, grads)


def structs(mesh):
    def sds(shape, name):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, SPECS[name]))

    return {"w1": sds((LAYERS, D, F), "w1"), "w2": sds((LAYERS, F, D), "w2")}, sds((256, 2048, D), "x")
