"""Equinox MLP with a function-valued field, a plain step over the model and Adam's state (analysed as eqx.filter_jit runs it)."""
import equinox as eqx
import jax
import jax.numpy as jnp
import optax

FRAMEWORK = "equinox"
optim = optax.adam(1e-3)


@eqx.filter_value_and_grad
def loss_fn(model, x, y):
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def train_step(model, opt_state, x, y):
    loss, grads = loss_fn(model, x, y)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def build():
    model = eqx.nn.MLP(256, 10, 512, 3, key=jax.random.key(0))
    return model, optim.init(eqx.filter(model, eqx.is_array)), jnp.ones((128, 256)), jnp.zeros((128, 10))


def make():
    return train_step, build()


def lowered():
    return eqx.filter_jit(train_step).lower(*build()).lowered


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    step = eqx.filter_jit(train_step)
    model, opt_state, x, y = objects
    for _ in range(steps):
        model, opt_state, loss = step(model, opt_state, x, y)
    jax.block_until_ready(loss)


def loop(steps):
    run(build(), steps)
