"""Flax NNX inference under nnx.jit: a forward pass whose graph mode returns every Variable of the model it was handed (each a copy)."""
import jax
import jax.numpy as jnp
from flax import nnx

FRAMEWORK = "flax.nnx"


class Net(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(2048, 4096, rngs=rngs)
        self.l2 = nnx.Linear(4096, 4096, rngs=rngs)
        self.l3 = nnx.Linear(4096, 1000, rngs=rngs)

    def __call__(self, x):
        return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


@nnx.jit
def predict(model, x):
    return model(x)


def build():
    return Net(nnx.Rngs(0)), jnp.ones((256, 2048))


def make():
    return predict, build()


def lowered():
    return predict.lower(*build()).lowered


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    model, x = objects
    for _ in range(steps):
        jax.block_until_ready(predict(model, x))


def loop(steps):
    run(build(), steps)
