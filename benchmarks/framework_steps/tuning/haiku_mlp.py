"""Haiku MLP by hk.transform, a jax.jit step over params and Adam's state, donated."""
import haiku as hk
import jax
import jax.numpy as jnp
import optax

FRAMEWORK = "haiku"
optim = optax.adam(1e-3)
model = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([1024, 1024, 10])(x)))


def train_step(params, opt_state, x, y):
    def loss_fn(params):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(params, x), y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = optim.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


step = jax.jit(train_step, donate_argnums=(0, 1))


def build():
    x, y = jnp.ones((256, 784)), jnp.zeros((256,), jnp.int32)
    params = model.init(jax.random.key(0), x)
    return params, optim.init(params), x, y


def make():
    return step, build()


def lowered():
    return step.lower(*build())


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    params, opt_state, x, y = objects
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state, x, y)
    jax.block_until_ready(params)


def loop(steps):
    run(build(), steps)
