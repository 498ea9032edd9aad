import jax, jax.numpy as jnp
from jax import lax

def make(batch: int = 128):
    k = jax.random.PRNGKey(0)
    p = {'w': jax.random.normal(k, (256, 1000)) * 0.05, 'e': jax.random.normal(k, (3, 1000, 1000)) * 0.01}
    x = jnp.ones((batch, 256)); mode = jnp.array(1, jnp.int32); y = jnp.zeros((batch,), jnp.int32)
    def step(p, x, mode, y):
        def loss(p):
            h = x @ p['w']
            h = lax.switch(mode, [lambda h: jax.nn.relu(h) @ p['e'][0], lambda h: jnp.tanh(h) @ p['e'][1],
                                  lambda h: h @ p['e'][2]], h)
            h = lax.cond(jnp.sum(h) > 0, lambda h: h * 2.0, lambda h: h - 1.0, h)
            vals, idx = lax.top_k(h, 5)
            order = jnp.argsort(h, axis=-1)
            oh = jax.nn.one_hot(y, 1000)
            return -jnp.mean(jnp.sum(oh * jax.nn.log_softmax(h), -1)) + 1e-3 * jnp.sum(vals) + 0.0 * order[0, 0]
        l, g = jax.value_and_grad(loss)(p)
        vals, idx = lax.top_k(x @ p['w'], 5)
        return jax.tree.map(lambda a, b: a - 0.01 * b, p, g), l, idx
    return step, (p, x, mode, y)
