import jax, jax.numpy as jnp
def mk(key):
    w = jnp.ones((256, 512)) * 0.01; x = jnp.ones((64, 256))
    def step(w, key, x):
        key, sub = jax.random.split(key)
        def loss(w):
            h = jax.nn.relu(x @ w)
            keep = jax.random.bernoulli(sub, 0.9, h.shape)
            return jnp.where(keep, h / 0.9, 0.0).sum()
        return w - 0.1 * jax.grad(loss)(w), key
    return step, (w, key, x)
def typed(): return mk(jax.random.key(0))
def raw(): return mk(jax.random.PRNGKey(0))
def fwd_typed():
    key = jax.random.key(0); x = jnp.ones((1024, 1024))
    return (lambda key, x: jnp.where(jax.random.bernoulli(key, 0.9, x.shape), x, 0.0)), (key, x)
def nodrop():
    w = jnp.ones((256, 512)) * 0.01; x = jnp.ones((64, 256))
    def step(w, x):
        return w - 0.1 * jax.grad(lambda w: jax.nn.relu(x @ w).sum())(w)
    return step, (w, x)
