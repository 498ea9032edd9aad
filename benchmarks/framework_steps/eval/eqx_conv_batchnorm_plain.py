"""Equinox convnet with eqx.nn.BatchNorm state (eqx.nn.State) and a static field, trained by a plain function of the model, its state and the optimizer state (analysed as eqx.filter_jit runs it)."""
import equinox as eqx
import jax
import jax.numpy as jnp
import optax

FRAMEWORK = "equinox"
BATCH, CLASSES = 64, 10
optim = optax.sgd(0.1, momentum=0.9)


class ConvNet(eqx.Module):
    convs: list
    norms: list
    head: eqx.nn.Linear
    pool_size: int = eqx.field(static=True)

    def __init__(self, key):
        keys = jax.random.split(key, 4)
        chans = [3, 32, 64, 128]
        self.convs = [eqx.nn.Conv2d(a, b, 3, padding=1, key=k) for a, b, k in zip(chans[:-1], chans[1:], keys)]
        self.norms = [eqx.nn.BatchNorm(c, axis_name="batch") for c in chans[1:]]
        self.head = eqx.nn.Linear(128, CLASSES, key=keys[3])
        self.pool_size = 2

    def __call__(self, x, state):
        for conv, norm in zip(self.convs, self.norms):
            x, state = norm(conv(x), state)
            x = jax.nn.relu(x)
            x = eqx.nn.MaxPool2d(self.pool_size, self.pool_size)(x)
        return self.head(x.mean(axis=(1, 2))), state


def loss_fn(model, state, x, y):
    logits, state = jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state


def train_step(model, state, opt_state, x, y):
    (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model, state, x, y)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), state, opt_state, loss


def build():
    model, state = eqx.nn.make_with_state(ConvNet)(jax.random.key(0))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    x = jnp.ones((BATCH, 3, 64, 64))
    y = jnp.zeros((BATCH,), jnp.int32)
    return model, state, opt_state, x, y


def make():
    return train_step, build()


def lowered():
    return eqx.filter_jit(train_step).lower(*build()).lowered


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    step = eqx.filter_jit(train_step)
    model, state, opt_state, x, y = objects
    for _ in range(steps):
        model, state, opt_state, loss = step(model, state, opt_state, x, y)
    jax.block_until_ready(eqx.filter(model, eqx.is_array))


def loop(steps):
    run(build(), steps)
