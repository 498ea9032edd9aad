"""Mixed precision with float16 compute, float32 master weights and a dynamic loss scale
(jmp-style): the scaled loss's gradients are unscaled, checked for overflow, and the update is
skipped when one is not finite."""
import jax, jax.numpy as jnp

D, H, C = 1024, 4096, 1000


def make(batch: int = 256):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {'w1': jax.random.normal(k[0], (D, H)) * 0.02, 'w2': jax.random.normal(k[1], (H, H)) * 0.02,
         'w3': jax.random.normal(k[2], (H, C)) * 0.02}
    x = jax.random.normal(k[3], (batch, D)); y = jnp.zeros((batch,), jnp.int32)
    scale = jnp.float32(2.0 ** 15)

    def loss(p, x, y):
        h = x.astype(jnp.float16)
        for name in ('w1', 'w2'):
            h = jax.nn.relu(h @ p[name].astype(jnp.float16))
        logits = (h @ p['w3'].astype(jnp.float16)).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], -1))

    def step(p, scale, x, y):
        g = jax.grad(lambda p: loss(p, x, y) * scale)(p)
        g = jax.tree.map(lambda t: t / scale, g)
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(t)) for t in jax.tree.leaves(g)]))
        new = jax.tree.map(lambda w, d: jnp.where(finite, w - 1e-3 * d, w), p, g)
        return new, jnp.where(finite, scale, scale / 2)
    return step, (p, scale, x, y)
