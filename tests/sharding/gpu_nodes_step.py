"""A step on 64 GPUs (8 nodes of 8): FSDP over `data`, tensor parallel over `model`, scanned
layers (the step of `tests/api/mesh_steps.py`, at other sizes and layouts). Imported by the test
and by the child that compiles it with JAX alone."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "api"))
from mesh_steps import step  # noqa: E402  (the scanned MLP stack's training step)

LAYERS, D, F = 4, 4096, 16384
SPECS = {"w1": P(None, "data", "model"), "w2": P(None, "model", "data"), "x": P("data", None, None)}
__all__ = ["step", "structs"]


def structs(mesh):
    def sds(shape, name):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, SPECS[name]))

    return {"w1": sds((LAYERS, D, F), "w1"), "w2": sds((LAYERS, F, D), "w2")}, sds((256, 2048, D), "x")
