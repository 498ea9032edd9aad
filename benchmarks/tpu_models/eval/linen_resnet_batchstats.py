"""Small linen ResNet with BatchNorm and odd channel counts (3->19->41->83), TrainState subclass carrying batch_stats, SGD momentum."""
from typing import Any

import jax
import jax.numpy as jnp
import flax.linen as nn
import optax
from flax.training import train_state

DONATE = (0,)


class TrainState(train_state.TrainState):
    batch_stats: Any


class ResBlock(nn.Module):
    features: int
    strides: int = 1
    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)
        y = nn.Conv(self.features, (3, 3), strides=(self.strides, self.strides), use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = norm()(y)
        if x.shape[-1] != self.features or self.strides != 1:
            x = nn.Conv(self.features, (1, 1), strides=(self.strides, self.strides), use_bias=False)(x)
            x = norm()(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    num_classes: int = 10
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(19, (3, 3), use_bias=False)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        for i, (f, s) in enumerate([(19, 1), (41, 2), (41, 1), (83, 2), (83, 1)]):
            x = ResBlock(f, s)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes)(x)


def train_step(state, images, labels):
    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, images,
                                         train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates
    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads)
    state = state.replace(batch_stats=updates["batch_stats"])
    return state, loss


def make():
    model = ResNet()
    variables = jax.jit(model.init, static_argnames="train")(jax.random.key(0), jnp.ones((1, 32, 32, 3)), train=False)
    tx = optax.sgd(optax.cosine_decay_schedule(0.1, 10_000), momentum=0.9, nesterov=True)
    state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx,
                              batch_stats=variables["batch_stats"])
    images = jax.random.normal(jax.random.key(1), (128, 32, 32, 3))
    labels = jax.random.randint(jax.random.key(2), (128,), 0, 10)
    return train_step, (state, images, labels)
