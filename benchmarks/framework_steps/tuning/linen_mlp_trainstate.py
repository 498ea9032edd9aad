"""Flax linen MLP in a TrainState, jax.jit without donation."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

FRAMEWORK = "flax.linen"


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (1024, 1024):
            x = nn.relu(nn.Dense(width)(x))
        return nn.Dense(10)(x)


@jax.jit
def train_step(state, x, y):
    def loss_fn(params):
        return optax.softmax_cross_entropy_with_integer_labels(state.apply_fn({"params": params}, x), y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def build():
    model = MLP()
    x, y = jnp.ones((256, 784)), jnp.zeros((256,), jnp.int32)
    params = model.init(jax.random.key(0), x[:1])["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3)), x, y


def make():
    return train_step, build()


def lowered():
    return train_step.lower(*build())


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    state, x, y = objects
    for _ in range(steps):
        state, loss = train_step(state, x, y)
    jax.block_until_ready(state)


def loop(steps):
    run(build(), steps)
