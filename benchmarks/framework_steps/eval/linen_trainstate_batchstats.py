"""Flax linen ResNet-style convnet with BatchNorm: a TrainState subclass carrying batch_stats, the mutable collection returned by apply_fn, jax.jit with the state donated."""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

FRAMEWORK = "flax.linen"
BATCH = 64


class Block(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x, train: bool):
        y = nn.Conv(self.features, (3, 3))(x)
        y = nn.relu(nn.BatchNorm(use_running_average=not train)(y))
        y = nn.Conv(self.features, (3, 3))(y)
        y = nn.BatchNorm(use_running_average=not train)(y)
        if x.shape[-1] != self.features:
            x = nn.Conv(self.features, (1, 1))(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        for features in (64, 128, 256):
            x = Block(features)(x, train)
            x = nn.max_pool(x, (2, 2), (2, 2))
        return nn.Dense(10)(x.mean(axis=(1, 2)))


class TrainState(train_state.TrainState):
    batch_stats: Any


def train_step(state, images, labels):
    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, images,
                                         mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
    return state, loss


step = jax.jit(train_step, donate_argnums=0)


def build():
    model = ResNet()
    images = jnp.ones((BATCH, 64, 64, 3))
    labels = jnp.zeros((BATCH,), jnp.int32)
    variables = model.init(jax.random.key(0), images[:1])
    state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optax.adam(1e-3),
                              batch_stats=variables["batch_stats"])
    return state, images, labels


def make():
    return step, build()


def lowered():
    return step.lower(*build())


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    state, images, labels = objects
    for _ in range(steps):
        state, loss = step(state, images, labels)
    jax.block_until_ready(state)


def loop(steps):
    run(build(), steps)
