"""Flax NNX MLP of 23M parameters with Adam, batch 2048, trained by a plain function that calls nnx.value_and_grad and optimizer.update (the step NNX users write before putting nnx.jit on it)."""
import jax
import jax.numpy as jnp
import optax
from flax import nnx

FRAMEWORK = "flax.nnx"


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(1024 if i == 0 else 2048, 2048, rngs=rngs) for i in range(6)])
        self.out = nnx.Linear(2048, 10, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers:
            x = jax.nn.relu(layer(x))
        return self.out(x)


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def build():
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    return model, optimizer, jnp.ones((2048, 1024)), jnp.zeros((2048,), jnp.int32)


def make():
    return train_step, build()


def lowered():
    return nnx.jit(train_step).lower(*build()).lowered


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    step = nnx.jit(train_step)
    model, optimizer, x, y = objects
    for _ in range(steps):
        jax.block_until_ready(step(model, optimizer, x, y))


def loop(steps):
    run(build(), steps)
