"""A Flax linen training loop that alternates a TrainState train step and an eval step over a larger held-out batch: two programs in one process, both with temporaries."""
import jax, jax.numpy as jnp, optax
import flax.linen as nn
from flax.training import train_state


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(48, (3, 3))(x))
        x = nn.avg_pool(x, (2, 2), (2, 2))
        x = nn.relu(nn.Conv(96, (3, 3))(x))
        x = x.mean((1, 2))
        return nn.Dense(10)(nn.relu(nn.Dense(256)(x)))


def _state():
    model = Net()
    params = model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)))["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.05, momentum=0.9))


def make(batch: int = 512):
    state = _state()
    images = jnp.full((batch, 32, 32, 3), 0.5)
    labels = jnp.arange(batch, dtype=jnp.int32) % 10

    def train_step(state, images, labels):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, images)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss
    return train_step, (state, images, labels)


def make_eval(batch: int = 1024):
    """The eval step: its first argument is the train step's first (the TrainState)."""
    state = _state()
    images = jnp.full((batch, 32, 32, 3), 0.25)
    labels = jnp.arange(batch, dtype=jnp.int32) % 10

    def eval_step(state, images, labels):
        logits = state.apply_fn({"params": state.params}, images)
        return (logits.argmax(-1) == labels).mean(), optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return eval_step, (state, images, labels)
