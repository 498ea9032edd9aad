import jax, jax.numpy as jnp
from jax import lax
def one():
    c = jnp.zeros((4096, 4096)); u = jnp.ones((1, 4096)); i = jnp.array(3, jnp.int32)
    return (lambda c, u, i: lax.dynamic_update_slice(c, u, (i, 0))), (c, u, i)
def chain_read():
    c = jnp.zeros((4, 1024, 1024)); u = jnp.ones((1, 1, 1024)); i = jnp.array(3, jnp.int32)
    def f(c, u, i):
        s = 0.0
        for l in range(4):
            c = lax.dynamic_update_slice(c, u * l, (l, i, 0))
            s = s + jnp.sum(c[l] @ c[l][:, :8])
        return c, s
    return f, (c, u, i)
