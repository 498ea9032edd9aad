"""A factory whose arguments are sharded over a mesh of this host's 8 CPU devices (the child sets
`--xla_force_host_platform_device_count`); jaxmem maps that mesh onto compile-only GPUs."""

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


def make():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:8])
    w = jax.device_put(jnp.ones((512, 1024), jnp.float32), NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((256, 512), jnp.float32), NamedSharding(mesh, P("data")))

    def fn(w, x):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    return fn, (w, x)
