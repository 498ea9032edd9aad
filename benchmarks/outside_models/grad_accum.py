"""Gradient accumulation: the batch split into microbatches, the loss's gradients summed by a
`lax.scan` over them, then one Adam (optax) step: how large batches are trained on small GPUs."""
import jax, jax.numpy as jnp, optax
from jax import lax

D, F, C = 512, 2048, 1000


def make(batch: int = 256, micro: int = 4):
    k = jax.random.split(jax.random.PRNGKey(0), 4)
    p = {'w1': jax.random.normal(k[0], (D, F)) * 0.02, 'w2': jax.random.normal(k[1], (F, F)) * 0.02,
         'w3': jax.random.normal(k[2], (F, C)) * 0.02}
    opt = optax.adam(1e-3)
    st = opt.init(p)
    x = jax.random.normal(k[3], (batch, D)); y = jnp.zeros((batch,), jnp.int32)

    def loss(p, x, y):
        h = jax.nn.gelu(x @ p['w1']); h = jax.nn.gelu(h @ p['w2'])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p['w3'], y).mean()

    def step(p, st, x, y):
        xs, ys = x.reshape(micro, -1, D), y.reshape(micro, -1)
        def acc(g, xy):
            l, gi = jax.value_and_grad(loss)(p, *xy)
            return jax.tree.map(jnp.add, g, gi), l
        g, ls = lax.scan(acc, jax.tree.map(jnp.zeros_like, p), (xs, ys))
        g = jax.tree.map(lambda t: t / micro, g)
        u, st = opt.update(g, st, p)
        return optax.apply_updates(p, u), st, ls.mean()
    return step, (p, st, x, y)
