"""An NNX training step written like the one in google/flax#5116 (a model, an nnx.Optimizer,
nnx.value_and_grad inside nnx.jit), and the same step written pure (split once, a jax.jit of
the state with jax.value_and_grad, the state donated): the step a user compares it with."""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

DIM, HIDDEN, DEPTH, BATCH = 512, 2048, 4, 256


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, HIDDEN, rngs=rngs)
        self.down = nnx.Linear(HIDDEN, DIM, rngs=rngs)

    def __call__(self, x):
        return x + self.down(nnx.gelu(self.up(self.norm(x))))


class Model(nnx.Module):
    def __init__(self, rngs):
        self.blocks = nnx.List([Block(rngs) for _ in range(DEPTH)])
        self.head = nnx.Linear(DIM, 1, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)[:, 0]


def loss_fn(model, x, y):
    return jnp.mean((model(x) - y) ** 2)


def nnx_train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)  # UPDATE LINE
    return loss


def build():
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(1), (BATCH, DIM))
    y = jax.random.normal(jax.random.key(2), (BATCH,))
    return model, optimizer, x, y


def pure_step(model, optimizer):
    """The same step written pure: (step, state) with step(state, x, y) -> (loss, state)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adamw(1e-3)

    def step(state, x, y):
        params, rest, opt_state = state
        loss, grads = jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), x, y))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, (optax.apply_updates(params, updates), rest, opt_state)

    return jax.jit(step, donate_argnums=0), (params, rest, tx.init(params))
