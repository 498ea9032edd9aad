"""Sharded example programs over an 8-device `AbstractMesh`: `jaxmem analyze` maps the mesh
onto 8 compile-only GPUs of the preset (or 8 host devices with `--xla cpu`).

    jaxmem analyze jaxmem.examples.sharded:fsdp_step --device h100-80gb
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

from jaxmem.xla.sharding import layout_specs, with_specs
from jaxmem.examples.gpt import make_train_step

Example = tuple[Callable[..., Any], tuple[Any, ...]]


def _abstract_step(**sizes: int) -> Example:
    """A GPT training step with `jax.ShapeDtypeStruct` arguments (nothing allocated)."""
    holder: dict[str, Any] = {}

    def build() -> tuple[Any, ...]:
        fn, args = make_train_step(**sizes)
        holder["fn"] = fn
        return args

    args = jax.eval_shape(build)
    return holder["fn"], tuple(args)


def _laid_out(layout: str, mesh_sizes: tuple[int, ...], names: tuple[str, ...], **sizes: int) -> Example:
    fn, args = _abstract_step(**sizes)
    mesh = AbstractMesh(mesh_sizes, names)
    return fn, with_specs(args, layout_specs(args, layout, dict(zip(names, mesh_sizes))), mesh)


SMALL = dict(n_layers=1, d_model=256, n_heads=4, seq=128, batch=16, vocab=4096)


def dp_step() -> Example:
    """A one-block GPT step, data parallel on 8 devices: parameters and Adam state replicated."""
    return _laid_out("dp", (8,), ("data",), **SMALL)


def fsdp_step() -> Example:
    """The same step with parameters and Adam state sharded over the 8 devices (FSDP)."""
    return _laid_out("fsdp", (8,), ("data",), **SMALL)


def tp_step() -> Example:
    """The same step on a 4x2 mesh (data, model): FSDP over data and tensor parallel over model."""
    return _laid_out("fsdp_tp", (4, 2), ("data", "model"), **SMALL)


def tiny_step() -> Example:
    """A tiny unsharded GPT step (1 layer, d_model 64, vocab 512, batch 16) for tests of the
    standard layouts (`--compare-shardings`)."""
    return _abstract_step(n_layers=1, d_model=64, n_heads=2, seq=32, batch=16, vocab=512)


def gpt_step() -> Example:
    """An unsharded GPT-style Adam step (32 layers, d_model 2560, 20 heads, seq 1024, batch 16,
    vocab 50304: about 2.65B parameters, float32) for `--compare-shardings --mesh 8`: the
    benchmark's program. Replicated, its parameters and Adam state alone are 31.8 GB per device."""
    return _abstract_step(n_layers=32, d_model=2560, n_heads=20, seq=1024, batch=16, vocab=50304)


def shard_map_step() -> Example:
    """A `shard_map` program on 8 devices: a per-device MLP on the local batch, its result summed
    over the mesh (`psum`)."""
    mesh = AbstractMesh((8,), ("data",))

    def body(w1: jax.Array, w2: jax.Array, x: jax.Array) -> jax.Array:
        h = jnp.tanh(x @ w1)
        return jax.lax.psum(jnp.sum((h @ w2) ** 2), "data")

    def fn(w1: jax.Array, w2: jax.Array, x: jax.Array) -> jax.Array:
        return jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P())(w1, w2, x)

    def struct(shape: tuple[int, ...], spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    return fn, (struct((512, 2048), P()), struct((2048, 512), P()), struct((1024, 512), P("data")))


def constraint_step() -> Example:
    """`with_sharding_constraint` inside the function: the hidden layer is sharded over data."""
    mesh = AbstractMesh((8,), ("data",))

    def fn(w: jax.Array, x: jax.Array) -> jax.Array:
        h = jax.lax.with_sharding_constraint(jnp.tanh(x @ w), NamedSharding(mesh, P("data", None)))
        return jnp.sum(h @ w.T)

    def struct(shape: tuple[int, ...], spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    return fn, (struct((1024, 1024), P()), struct((256, 1024), P("data")))


def bad_divisor() -> Example:
    """A sharding that does not divide its shape (for the error test)."""
    fn, args = shard_map_step()
    mesh = AbstractMesh((8,), ("data",))
    x = jax.ShapeDtypeStruct((1020, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    return fn, (*args[:2], x)


def unknown_axis() -> Example:
    """A function whose collective names an axis the mesh does not have (for the error test)."""
    mesh = AbstractMesh((8,), ("data",))

    def body(x: jax.Array) -> jax.Array:
        return jax.lax.psum(x, "model")

    def fn(x: jax.Array) -> jax.Array:
        return jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P())(x)

    return fn, (jax.ShapeDtypeStruct((64, 8), jnp.float32, sharding=NamedSharding(mesh, P("data"))),)


def big_mesh() -> Example:
    """A mesh of 12 devices: more than one 8-GPU node, and not whole nodes (for the error test)."""
    mesh = AbstractMesh((12,), ("data",))
    x = jax.ShapeDtypeStruct((48, 8), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    return (lambda x: x * 2), (x,)
