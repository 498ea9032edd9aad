"""Plain JAX MLP whose widths are multiples of neither 8 nor 128 (100 -> 300 -> 77 -> 10), Adam from optax."""
import jax, jax.numpy as jnp, optax

WIDTHS = (100, 300, 77, 10)


def make(batch: int = 50):
    keys = jax.random.split(jax.random.PRNGKey(0), len(WIDTHS))
    params = [{"w": jax.random.normal(k, (a, b)) * a ** -0.5, "b": jnp.zeros((b,))}
              for k, a, b in zip(keys, WIDTHS[:-1], WIDTHS[1:])]
    tx = optax.adam(1e-3)
    opt = tx.init(params)
    x = jax.random.normal(keys[-1], (batch, WIDTHS[0]))
    y = jnp.arange(batch, dtype=jnp.int32) % WIDTHS[-1]

    def step(params, opt, x, y):
        def loss(params):
            h = x
            for layer in params[:-1]:
                h = jax.nn.gelu(h @ layer["w"] + layer["b"])
            logits = h @ params[-1]["w"] + params[-1]["b"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt)
        return optax.apply_updates(params, updates), opt, value
    return step, (params, opt, x, y)
