"""Hundreds of tiny parameter arrays: 240 per-channel scales and shifts of 3 to 17 entries, SGD with momentum."""
import jax, jax.numpy as jnp, optax


def make(batch: int = 32):
    sizes = [3 + (i % 15) for i in range(120)]
    params = {f"unit{i}": {"scale": jnp.ones((n,)), "shift": jnp.zeros((n,))} for i, n in enumerate(sizes)}
    xs = {f"unit{i}": jnp.full((batch, n), 0.1 * (i % 7)) for i, n in enumerate(sizes)}
    tx = optax.sgd(1e-2, momentum=0.9)
    opt = tx.init(params)

    def step(params, opt, xs):
        def loss(params):
            return sum(jnp.mean(jnp.tanh(xs[k] * p["scale"] + p["shift"]) ** 2) for k, p in params.items())
        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value
    return step, (params, opt, xs)
