"""Flax NNX CNN classifier (nnx.Conv, nnx.BatchNorm, max and average pooling, dropout) trained with nnx.Optimizer(adamw) through the split/merge functional pattern."""
from functools import partial
import jax, jax.numpy as jnp, optax
from flax import nnx


class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        chans = [3, 64, 128, 256]
        self.convs = nnx.List([nnx.Conv(a, b, (3, 3), rngs=rngs) for a, b in zip(chans[:-1], chans[1:])])
        self.bns = nnx.List([nnx.BatchNorm(b, rngs=rngs) for b in chans[1:]])
        self.drop = nnx.Dropout(0.2, rngs=rngs)
        self.head = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        for conv, bn in zip(self.convs, self.bns):
            x = nnx.relu(bn(conv(x)))
            x = nnx.max_pool(x, (2, 2), (2, 2))
        x = nnx.avg_pool(x, (x.shape[1], x.shape[2])).reshape(x.shape[0], -1)
        return self.head(self.drop(x))


def make(batch: int = 64):
    model = CNN(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    x = jnp.ones((batch, 32, 32, 3)); y = jnp.zeros((batch,), jnp.int32)

    def train_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        model.train()
        def loss_fn(model):
            logits = model(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss
    return train_step, (state, x, y)
