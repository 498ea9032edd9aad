"""Deep residual MLP in linen with nn.remat + nn.scan over 24 stacked layers (width 1000), TrainState + Lion."""
import functools

import jax
import jax.numpy as jnp
import flax.linen as nn
import optax
from flax.training import train_state

WIDTH, LAYERS = 1000, 24


class ResidualLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        h = nn.Dense(WIDTH * 2)(h)
        h = nn.silu(h)
        h = nn.Dense(WIDTH)(h)
        return x + h, None


class DeepMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(WIDTH)(x)
        Stack = nn.scan(nn.remat(ResidualLayer), variable_axes={"params": 0}, split_rngs={"params": True},
                        length=LAYERS)
        x, _ = Stack(name="layers")(x, None)
        return nn.Dense(13)(nn.LayerNorm()(x))


def train_step(state, x, y):
    def loss_fn(params):
        pred = state.apply_fn({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(pred, y).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def make():
    model = DeepMLP()
    params = model.init(jax.random.key(0), jnp.ones((1, 300)))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.lion(1e-4, weight_decay=0.1))
    x = jax.random.normal(jax.random.key(1), (384, 300))
    y = jax.random.randint(jax.random.key(2), (384,), 0, 13)
    return train_step, (state, x, y)
