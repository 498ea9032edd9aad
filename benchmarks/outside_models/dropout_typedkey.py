import jax, jax.numpy as jnp

def make(batch: int = 64):
    key = jax.random.key(0)
    k1, k2 = jax.random.split(key)
    p = {'w1': jax.random.normal(k1, (512, 1024)) * 0.02, 'w2': jax.random.normal(k2, (1024, 10)) * 0.02}
    x = jnp.ones((batch, 512)); y = jnp.zeros((batch,), jnp.int32)
    def step(p, key, x, y):
        key, sub = jax.random.split(key)
        def loss(p):
            h = jax.nn.relu(x @ p['w1'])
            keep = jax.random.bernoulli(sub, 0.9, h.shape)
            h = jnp.where(keep, h / 0.9, 0.0)
            lg = jax.nn.log_softmax(h @ p['w2'])
            return -jnp.mean(jnp.take_along_axis(lg, y[:, None], -1))
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), key, l
    return step, (p, key, x, y)
