import jax, jax.numpy as jnp

@jax.custom_vjp
def clip_grad(x):
    return x
def _f(x): return x, None
def _b(_, g): return (jnp.clip(g, -1.0, 1.0),)
clip_grad.defvjp(_f, _b)

def make(batch: int = 64):
    k = jax.random.PRNGKey(0)
    p = {'w1': jax.random.normal(k, (256, 512)) * 0.05, 'w2': jax.random.normal(k, (512, 1)) * 0.05}
    x = jnp.ones((batch, 256)); y = jnp.zeros((batch,))
    def loss(p, xi, yi):
        h = jnp.tanh(clip_grad(xi @ p['w1']))
        return ((h @ p['w2'])[0] - yi) ** 2
    def step(p, x, y):
        g = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(p, x, y)   # per-example grads
        norms = jnp.sqrt(sum(jnp.sum(v.reshape(batch, -1) ** 2, 1) for v in jax.tree.leaves(g)))
        scale = jnp.minimum(1.0, 1.0 / (norms + 1e-6))
        g = jax.tree.map(lambda v: jnp.mean(v * scale.reshape((-1,) + (1,) * (v.ndim - 1)), 0), g)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)
    return step, (p, x, y)
