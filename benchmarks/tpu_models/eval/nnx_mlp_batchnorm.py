"""Flax NNX MLP classifier with BatchNorm and Dropout (widths 1000, 77), nnx.Optimizer, split/merge pure step."""
import jax
import jax.numpy as jnp
import optax
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, din, dhid, dmid, dout, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dhid, rngs=rngs)
        self.bn1 = nnx.BatchNorm(dhid, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.linear2 = nnx.Linear(dhid, dmid, rngs=rngs)
        self.bn2 = nnx.BatchNorm(dmid, rngs=rngs)
        self.linear3 = nnx.Linear(dmid, dout, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn1(self.linear1(x)))
        x = self.dropout(x)
        x = nnx.relu(self.bn2(self.linear2(x)))
        return self.linear3(x)


def loss_fn(model, x, y):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make():
    model = MLP(617, 1000, 77, 26, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=1e-4), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def train_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        model.train()
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    x = jax.random.normal(jax.random.key(1), (1024, 617))
    y = jax.random.randint(jax.random.key(2), (1024,), 0, 26)
    return train_step, (state, x, y)
