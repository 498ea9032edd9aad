"""Plain JAX SGD step, jax.jit with a keyword array argument and a static keyword, no donation."""
import functools

import jax
import jax.numpy as jnp

FRAMEWORK = "jax"


@functools.partial(jax.jit, static_argnames=("activation",))
def train_step(w, x, *, lr, activation):
    act = {"tanh": jnp.tanh, "relu": jax.nn.relu}[activation]
    grad = jax.grad(lambda w: jnp.mean(act(x @ w) ** 2))(w)
    return w - lr * grad


def build():
    return jnp.ones((2048, 2048)) * 0.01, jnp.ones((512, 2048))


def keywords():
    return {"lr": jnp.float32(0.1), "activation": "tanh"}


def make():
    return train_step, build()


def lowered():
    return train_step.lower(*build(), **keywords())


def run(objects, steps):
    """The user's loop, `steps` steps, on what `build()` made."""
    w, x = objects
    for _ in range(steps):
        w = train_step(w, x, **keywords())
    jax.block_until_ready(w)


def loop(steps):
    run(build(), steps)
