"""Training steps written the way users write them, with Flax (linen and NNX), Equinox and optax.

Each factory returns `(step, args)` with `args = (params, opt_state, batch)`: the parameters
and the optimizer state are updated and returned, the batch is only read. The model code lives in
this file, so a report that names the user's line names a line here.
"""

from __future__ import annotations

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx

BATCH, IN, HIDDEN, OUT = 256, 384, 512, 10


def _batch(key, size=BATCH):
    kx, ky = jax.random.split(key)
    return {"x": jax.random.normal(kx, (size, IN)), "y": jax.random.randint(ky, (size,), 0, OUT)}


def _loss(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(HIDDEN)(x))          # LINEN_HIDDEN_1
        x = nn.relu(nn.Dense(HIDDEN)(x))          # LINEN_HIDDEN_2
        return nn.Dense(OUT)(x)


def flax_linen_step(batch_size=BATCH):
    model, tx = LinenMLP(), optax.adam(1e-3)
    batch = _batch(jax.random.key(1), batch_size)
    params = model.init(jax.random.key(0), batch["x"])
    opt_state = tx.init(params)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: _loss(model.apply(p, batch["x"]), batch["y"]))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, batch)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(IN, HIDDEN, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.l3 = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.l1(x))                  # NNX_HIDDEN_1
        x = nnx.relu(self.l2(x))                  # NNX_HIDDEN_2
        return self.l3(x)


def flax_nnx_step():
    graphdef, params = nnx.split(NnxMLP(nnx.Rngs(0)))
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    def step(params, opt_state, batch):
        def loss_fn(p):
            return _loss(nnx.merge(graphdef, p)(batch["x"]), batch["y"])
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, _batch(jax.random.key(1)))


class EqxMLP(eqx.Module):
    layers: list

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.layers = [eqx.nn.Linear(IN, HIDDEN, key=k1), eqx.nn.Linear(HIDDEN, HIDDEN, key=k2),
                       eqx.nn.Linear(HIDDEN, OUT, key=k3)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = jax.nn.relu(jax.vmap(layer)(x))   # EQX_HIDDEN
        return jax.vmap(self.layers[-1])(x)


def equinox_step():
    model = EqxMLP(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)

    def step(params, opt_state, batch):
        def loss_fn(p):
            return _loss(eqx.combine(p, static)(batch["x"]), batch["y"])
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, _batch(jax.random.key(1)))


STEPS = {"flax_linen": flax_linen_step, "flax_nnx": flax_nnx_step, "equinox": equinox_step}
