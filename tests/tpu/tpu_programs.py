"""Small programs for the TPU tests, loadable by a child process as `tpu_programs:NAME` from
this folder (`tests/tpu/tpu_programs.py:NAME`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

MiB = 1 << 20


def rows_step(rows: int = 4):
    """A step over `rows` MiB-rows of float32 state (each row 1024 x 256 f32 = 1 MiB, tiled
    exactly on a TPU): state -> state * 0.5 + 1 and its sum, the state donated."""
    def step(state):
        return state * 0.5 + 1.0, jnp.sum(state)

    return jax.jit(step, donate_argnums=0), (jax.ShapeDtypeStruct((rows * 1024, 256), jnp.float32),)


def over_hbm():
    """An elementwise step over 20 GiB: more than a v5e's HBM."""
    def step(x):
        return jnp.sin(x) * 2.0

    return step, (jax.ShapeDtypeStruct((20 * 1024, 256 * 1024), jnp.float32),)


def narrow_columns():
    """Arrays a TPU pads: f32[4096, 3] takes 4096 x 128 x 4 B in its tiled layout."""
    def step(x, w):
        return jnp.tanh(x @ w), x * 2.0

    return step, (jax.ShapeDtypeStruct((4096, 3), jnp.float32), jax.ShapeDtypeStruct((3, 5), jnp.float32))


# -- every pytree jax.jit accepts (tests/tpu/test_tpu_pytrees.py) -----------------------------

def _mlp(params, x):
    return jnp.tanh(x @ params["w"] + params["b"]) @ params["v"]


def _mlp_params(width: int = 37):
    return {"w": jnp.full((16, width), 0.1), "b": jnp.zeros((width,)), "v": jnp.full((width, 3), 0.1)}


def python_scalars():
    """A step taking Python scalars as jax.jit does (a learning rate, a count, a flag)."""
    def step(params, x, lr, count, train):
        grads = jax.grad(lambda p: jnp.sum(_mlp(p, x) ** 2))(params)
        scale = jnp.where(train, lr, 0.0) / (count + 1)
        return jax.tree.map(lambda p, g: p - scale * g, params, grads), count + 1

    return step, (_mlp_params(), jnp.ones((8, 16)), 0.01, 0, True)


def typed_key_and_none():
    """A typed PRNG key in the state, and None leaves (jax.tree drops them)."""
    def step(state, x):
        key, sub = jax.random.split(state["key"])
        noise = jax.random.normal(sub, x.shape)
        grads = jax.grad(lambda p: jnp.sum(_mlp(p, x + noise) ** 2))(state["params"])
        params = jax.tree.map(lambda p, g: p - 0.01 * g, state["params"], grads)
        return {"key": key, "params": params, "unused": None}

    return step, ({"key": jax.random.key(0), "params": _mlp_params(), "unused": None}, jnp.ones((8, 16)))


def namedtuple_and_dataclass():
    """A NamedTuple state holding a registered dataclass."""
    import dataclasses
    from typing import NamedTuple

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Moments:
        mean: jax.Array
        var: jax.Array

    class State(NamedTuple):
        params: dict
        moments: Moments
        step: jax.Array

    def step(state, x):
        grads = jax.grad(lambda p: jnp.sum(_mlp(p, x) ** 2))(state.params)
        mean = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, state.moments.mean, grads)
        var = jax.tree.map(lambda v, g: 0.99 * v + 0.01 * g * g, state.moments.var, grads)
        params = jax.tree.map(lambda p, m, v: p - 0.01 * m / (jnp.sqrt(v) + 1e-8), state.params, mean, var)
        return State(params, Moments(mean, var), state.step + 1)

    params = _mlp_params()
    zeros = jax.tree.map(jnp.zeros_like, params)
    return step, (State(params, Moments(zeros, zeros), jnp.zeros((), jnp.int32)), jnp.ones((8, 16)))


def flax_train_state():
    """A Flax linen TrainState (its step a Python int, its params a FrozenDict) with optax Adam."""
    import flax.linen as nn
    import optax
    from flax.core import freeze
    from flax.training import train_state

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.tanh(nn.Dense(37)(x)))

    model = Net()
    params = freeze(model.init(jax.random.PRNGKey(0), jnp.ones((1, 16)))["params"])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

    def step(state, x, y):
        grads = jax.grad(lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2))(state.params)
        return state.apply_gradients(grads=grads)

    return step, (state, jnp.ones((8, 16)), jnp.zeros((8, 3)))


def nnx_state():
    """Flax NNX: a model and its nnx.Optimizer split into a graph and a State, stepped purely."""
    import optax
    from flax import nnx

    model = nnx.Linear(16, 37, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.sgd(0.01, momentum=0.9), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    def step(state, x):
        model, optimizer = nnx.merge(graphdef, state)
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    return step, (state, jnp.ones((8, 16)))


def equinox_module():
    """An Equinox module with a static field, partitioned into arrays and the rest."""
    import equinox as eqx

    class Net(eqx.Module):
        layer: eqx.nn.Linear
        scale: float = eqx.field(static=True)

        def __call__(self, x):
            return self.scale * jnp.tanh(self.layer(x))

    net = Net(eqx.nn.Linear(16, 37, key=jax.random.PRNGKey(0)), 0.5)
    params, static = eqx.partition(net, eqx.is_array)

    def step(params, x):
        def loss(p):
            return jnp.sum(jax.vmap(eqx.combine(p, static))(x) ** 2)
        grads = jax.grad(loss)(params)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)

    return step, (params, jnp.ones((8, 16)))


def optax_state():
    """optax's own state pytrees (ScaleByAdamState, EmptyState in a chain) with clipping."""
    import optax

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    params = _mlp_params()

    def step(params, opt, x):
        grads = jax.grad(lambda p: jnp.sum(_mlp(p, x) ** 2))(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    return step, (params, tx.init(params), jnp.ones((8, 16)))


PYTREE_KINDS = ("python_scalars", "typed_key_and_none", "namedtuple_and_dataclass", "flax_train_state", "nnx_state",
                "equinox_module", "optax_state")


# -- a factory that runs programs of its own before the step (tests/tpu/test_tpu_factory.py) --

@jax.jit
def make_ones():
    return jnp.ones((256, 37))


@jax.jit
def doubled(a):
    return a * 2.0


def ones_alone():
    return make_ones, ()


def doubled_alone():
    return doubled, (jax.ShapeDtypeStruct((256, 37), jnp.float32),)


def eager_factory():
    """A factory that runs two programs of its own (`make_ones`, `doubled`) to build the state."""
    state = doubled(make_ones())

    def step(state):
        return state * 0.5

    return step, (state,)
