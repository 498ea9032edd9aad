"""A tensor-parallel layer on a 4x2 (data, model) `AbstractMesh`: the batch split over data, the
weight's columns over model. XLA keeps the hidden activation split both ways, (256, 1024) as
(64, 512) per device; a per-device program that gathered the weight whole would hold (64, 1024)."""

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P


def make():
    mesh = AbstractMesh((4, 2), ("data", "model"))

    def fn(x, w, v):
        h = jnp.tanh(x @ w)
        return jnp.sum(h @ v)

    def struct(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    return fn, (struct((256, 512), P("data", None)), struct((512, 1024), P(None, "model")),
                struct((1024, 128), P("model", None)))
