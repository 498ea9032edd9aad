import jax, jax.numpy as jnp
from jax import lax

def make(batch: int = 64):
    k = jax.random.PRNGKey(0)
    A = jax.random.normal(k, (512, 512)) * 0.01 + jnp.eye(512) * 2.0
    b = jnp.ones((batch, 512))
    def solve(A, b):
        # Jacobi-like iteration until the residual is small: trip count depends on data
        d = jnp.diag(A)
        def cond(s):
            x, r, i = s
            return (r > 1e-4) & (i < 200)
        def body(s):
            x, r, i = s
            xn = (b - x @ (A - jnp.diag(d)).T) / d
            return xn, jnp.max(jnp.abs(xn - x)), i + 1
        x, r, i = lax.while_loop(cond, body, (jnp.zeros_like(b), jnp.array(1.0), 0))
        return x, i
    return solve, (A, b)
