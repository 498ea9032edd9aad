"""A training loop that keeps one device array per step (the losses' activations, 4 MiB each):
the leak `jaxmem record` must name with its line and its bytes per step.

    jaxmem record --out leak -- python benchmarks/recording/leak_loop.py 24
"""
import sys

import jax
import jax.numpy as jnp


@jax.jit
def train_step(w, x):
    def loss(w):
        h = jnp.tanh(x @ w)
        return (h * h).mean(), h
    (value, h), grad = jax.value_and_grad(loss, has_aux=True)(w)
    return w - 0.01 * grad, value, h


def main(steps: int) -> None:
    w = jnp.ones((1024, 1024), jnp.float32) * 0.01
    x = jnp.ones((1024, 1024), jnp.float32)
    kept = []
    for _ in range(steps):
        w, value, h = train_step(w, x)
        kept.append(h)  # the leak: every step's activations stay referenced
        float(value)
    print(f"{steps} steps, {len(kept)} arrays kept")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 24)
