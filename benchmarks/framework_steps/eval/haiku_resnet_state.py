"""Haiku ResNet-style net with hk.BatchNorm: hk.transform_with_state, a step over (params, state, opt_state) jitted with them donated."""
import haiku as hk
import jax
import jax.numpy as jnp
import optax

FRAMEWORK = "haiku"
BATCH = 64
optim = optax.adam(1e-3)


def net(x, is_training):
    for channels in (64, 128, 256):
        y = hk.Conv2D(channels, 3)(x)
        y = hk.BatchNorm(create_scale=True, create_offset=True, decay_rate=0.9)(y, is_training)
        y = jax.nn.relu(y)
        x = hk.Conv2D(channels, 1)(x) + hk.Conv2D(channels, 3)(y)
        x = hk.max_pool(x, 2, 2, "VALID")
    return hk.Linear(10)(x.mean(axis=(1, 2)))


model = hk.transform_with_state(net)


def train_step(params, state, opt_state, images, labels):
    def loss_fn(params):
        logits, new_state = model.apply(params, state, None, images, True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), new_state

    (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optim.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), state, opt_state, loss


step = jax.jit(train_step, donate_argnums=(0, 1, 2))


def build():
    images = jnp.ones((BATCH, 64, 64, 3))
    labels = jnp.zeros((BATCH,), jnp.int32)
    params, state = model.init(jax.random.key(0), images, True)
    return params, state, optim.init(params), images, labels


def make():
    return step, build()


def lowered():
    return step.lower(*build())


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    params, state, opt_state, images, labels = objects
    for _ in range(steps):
        params, state, opt_state, loss = step(params, state, opt_state, images, labels)
    jax.block_until_ready(params)


def loop(steps):
    run(build(), steps)
