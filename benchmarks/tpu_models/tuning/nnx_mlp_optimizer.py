"""Flax NNX MLP (odd widths 64 -> 250 -> 250 -> 3) with nnx.Optimizer, stepped as a pure function of its split state."""
import jax, jax.numpy as jnp, optax
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(64, 250, rngs=rngs)
        self.l2 = nnx.Linear(250, 250, rngs=rngs)
        self.l3 = nnx.Linear(250, 3, rngs=rngs)

    def __call__(self, x):
        return self.l3(nnx.relu(self.l2(nnx.relu(self.l1(x)))))


def make(batch: int = 128):
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    x = jnp.ones((batch, 64))
    y = jnp.zeros((batch,), jnp.int32)

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        def loss(model):
            return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), value
    return step, (state, x, y)
