"""Flax NNX residual MLP blocks stacked by nnx.vmap and run by nnx.scan, nnx.jit without donation, Adam."""
import jax
import jax.numpy as jnp
import optax
from flax import nnx

FRAMEWORK = "flax.nnx"
D, L, B = 1024, 8, 512


class Block(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.Linear(D, 4 * D, rngs=rngs)
        self.down = nnx.Linear(4 * D, D, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class Model(nnx.Module):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=L)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs):
            return Block(rngs)

        self.blocks = stack(rngs)
        self.head = nnx.Linear(D, 1, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x)

        return self.head(body(x, self.blocks))


@nnx.jit
def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x)[:, 0] - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss


def build():
    model = Model(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    return model, optimizer, jnp.ones((B, D)), jnp.zeros((B,))


def make():
    return train_step, build()


def lowered():
    return train_step.lower(*build()).lowered


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    model, optimizer, x, y = objects
    for _ in range(steps):
        jax.block_until_ready(train_step(model, optimizer, x, y))


def loop(steps):
    run(build(), steps)
