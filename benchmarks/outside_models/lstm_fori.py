import jax, jax.numpy as jnp
from jax import lax

Hd, T, In = 256, 64, 128

def make(batch: int = 32):
    k = jax.random.PRNGKey(0)
    p = {'wi': jax.random.normal(k, (In, 4 * Hd)) * 0.05, 'wh': jax.random.normal(k, (Hd, 4 * Hd)) * 0.05,
         'b': jnp.zeros((4 * Hd,)), 'out': jnp.zeros((Hd, 1))}
    xs = jnp.ones((T, batch, In)); y = jnp.zeros((batch, 1))
    def loss(p, xs, y):
        def body(t, carry):
            h, c = carry
            z = xs[t] @ p['wi'] + h @ p['wh'] + p['b']
            i, f, g, o = jnp.split(z, 4, -1)
            c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
            h = jax.nn.sigmoid(o) * jnp.tanh(c)
            return h, c
        h, c = lax.fori_loop(0, T, body, (jnp.zeros((batch, Hd)), jnp.zeros((batch, Hd))))
        return jnp.mean((h @ p['out'] - y) ** 2)
    def step(p, xs, y):
        l, g = jax.value_and_grad(loss)(p, xs, y)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l
    return step, (p, xs, y)
