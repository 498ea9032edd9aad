"""An ensemble of 8 MLPs trained at once: `jax.vmap` over stacked parameters of the whole SGD
step (the batched GEMMs XLA sees are what vmap makes of each member's)."""
import jax, jax.numpy as jnp

E, D, H, C = 8, 256, 1024, 10


def make(batch: int = 128):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    p = {'w1': jax.random.normal(k[0], (E, D, H)) * 0.02, 'w2': jax.random.normal(k[1], (E, H, C)) * 0.02}
    x = jax.random.normal(k[2], (E, batch, D)); y = jnp.zeros((E, batch), jnp.int32)

    def one(p, x, y):
        def loss(p):
            logits = jnp.tanh(x @ p['w1']) @ p['w2']
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], -1))
        l, g = jax.value_and_grad(loss)(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), l
    return jax.vmap(one), (p, x, y)
