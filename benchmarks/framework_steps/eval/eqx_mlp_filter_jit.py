"""Equinox MLP (its activation a field of the module), eqx.filter_jit with donate="all", eqx.filter_value_and_grad, AdamW with gradient clipping."""
import equinox as eqx
import jax
import jax.numpy as jnp
import optax

FRAMEWORK = "equinox"
IN, WIDTH, DEPTH, OUT, BATCH = 784, 2048, 4, 10, 1024
optim = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))


@eqx.filter_value_and_grad
def loss_fn(model, x, y):
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@eqx.filter_jit(donate="all")
def train_step(model, opt_state, x, y):
    loss, grads = loss_fn(model, x, y)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def build():
    model = eqx.nn.MLP(IN, OUT, WIDTH, DEPTH, activation=jax.nn.gelu, key=jax.random.key(0))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    x = jnp.ones((BATCH, IN))
    y = jnp.zeros((BATCH,), jnp.int32)
    return model, opt_state, x, y


def make():
    return train_step, build()


def lowered():
    return train_step.lower(*build()).lowered


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    model, opt_state, x, y = objects
    for _ in range(steps):
        model, opt_state, loss = train_step(model, opt_state, x, y)
        x, y = jnp.ones((BATCH, IN)), jnp.zeros((BATCH,), jnp.int32)   # the donated batch is gone: a new one
    jax.block_until_ready(eqx.filter(model, eqx.is_array))


def loop(steps):
    run(build(), steps)
