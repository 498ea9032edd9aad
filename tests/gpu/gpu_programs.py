"""Small programs for the GPU preflight tests, loadable as `tests/gpu/gpu_programs.py:NAME`.

Each factory returns `(fn, args)`; `abstract_*` ones return `jax.ShapeDtypeStruct` arguments
only, so programs of tens of GB cost nothing to build.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _mlp_step(params, x):
    def loss(p):
        h = jnp.tanh(x @ p["w1"])
        return jnp.mean((h @ p["w2"]) ** 2)

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss(params)


def mlp_step(batch_size: int = 64, width: int = 256):
    """A two-layer MLP SGD step on concrete arrays: `fn(params, x) -> (params, loss)`."""
    params = {"w1": jnp.ones((width, 4 * width), jnp.float32) * 0.01,
              "w2": jnp.ones((4 * width, width), jnp.float32) * 0.01}
    x = jnp.ones((batch_size, width), jnp.float32)
    return _mlp_step, (params, x)


def abstract_mlp_step(batch_size: int = 64, width: int = 256):
    """`mlp_step` with `jax.ShapeDtypeStruct` arguments (nothing is allocated)."""
    params = {"w1": jax.ShapeDtypeStruct((width, 4 * width), jnp.float32),
              "w2": jax.ShapeDtypeStruct((4 * width, width), jnp.float32)}
    x = jax.ShapeDtypeStruct((batch_size, width), jnp.float32)
    return _mlp_step, (params, x)


def abstract_big(batch_size: int = 4096):
    """An abstract MLP step with 8 GiB of float32 parameters (width 16384), about 26 GiB in all."""
    return abstract_mlp_step(batch_size=batch_size, width=16384)


def tanh_matmul():
    """`tanh(x @ w).sum()` on 256x512 and 512x512 float32."""
    return (lambda x, w: jnp.tanh(x @ w).sum()), (jnp.ones((256, 512)), jnp.ones((512, 512)))


def _frag_step(a, b, c):
    m = a.reshape(2048, 1024) @ b.reshape(1024, 2048)      # 16 MiB XLA must hold
    s = m.sum(axis=1)
    return b + s.sum(), c * 2.0, a - s.mean()


def fragmenting_step():
    """State of 8, 8 and 4 MiB returned in another order (8, 4, 8) with a 16 MiB product
    between: the second step's temp allocation finds the free bytes split in two."""
    return _frag_step, (jax.ShapeDtypeStruct((1 << 21,), jnp.float32), jax.ShapeDtypeStruct((1 << 21,), jnp.float32),
                        jax.ShapeDtypeStruct((1 << 20,), jnp.float32))


def _sgd_in_place(params):
    return jax.tree.map(lambda p: p - 0.001 * jnp.tanh(p), params)


def abstract_resident_64gib():
    """Eight float32 parameter blocks of 8 GiB (64 GiB) updated in place (donate 0): an abstract
    program whose XLA:GPU total is about 0.80 of an H100 80GB."""
    return _sgd_in_place, ({f"w{i}": jax.ShapeDtypeStruct((1 << 16, 1 << 15), jnp.float32) for i in range(8)},)


def _double(x):
    return x * 2.0


def rows_step(rows: int = 1):
    """`rows` rows of 48 MiB (float32[rows, 12582912]), doubled in place (donate 0)."""
    return _double, (jax.ShapeDtypeStruct((rows, 12 << 20), jnp.float32),)
