"""Equinox eqx.nn.GRUCell run with lax.scan over 300 time steps for sequence regression, static fields, filter partition, AdamW."""
import equinox as eqx
import jax
import jax.numpy as jnp
import optax


class RNNRegressor(eqx.Module):
    cell: eqx.nn.GRUCell
    readout: eqx.nn.Linear
    hidden_size: int = eqx.field(static=True)

    def __init__(self, in_size, hidden_size, out_size, *, key):
        ckey, lkey = jax.random.split(key)
        self.hidden_size = hidden_size
        self.cell = eqx.nn.GRUCell(in_size, hidden_size, key=ckey)
        self.readout = eqx.nn.Linear(hidden_size, out_size, key=lkey)

    def __call__(self, xs):  # xs: (T, in_size)
        def f(h, x):
            h = self.cell(x, h)
            return h, self.readout(h)
        _, ys = jax.lax.scan(f, jnp.zeros((self.hidden_size,)), xs)
        return ys


optim = optax.adamw(1e-3)


def make():
    model = RNNRegressor(7, 389, 3, key=jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = optim.init(params)

    def train_step(params, opt_state, xs, ys):
        @jax.value_and_grad
        def loss_fn(params):
            m = eqx.combine(params, static)
            pred = jax.vmap(m)(xs)
            return jnp.mean((pred - ys) ** 2)
        loss, grads = loss_fn(params)
        updates, opt_state = optim.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    xs = jax.random.normal(jax.random.key(1), (64, 300, 7))
    ys = jax.random.normal(jax.random.key(2), (64, 300, 3))
    return train_step, (params, opt_state, xs, ys)
