"""Equinox GRU forecaster: eqx.nn.GRUCell run over time with lax.scan per example (vmapped over the batch), a linear readout at every step, Huber loss, optax.adabelief."""
import jax, jax.numpy as jnp, equinox as eqx, optax
from jax import lax

F, HID, T = 32, 512, 96


class Forecaster(eqx.Module):
    cell: eqx.nn.GRUCell
    out: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.cell = eqx.nn.GRUCell(F, HID, key=k1)
        self.out = eqx.nn.Linear(HID, F, key=k2)

    def __call__(self, xs):
        def f(h, x):
            h = self.cell(x, h)
            return h, self.out(h)
        _, ys = lax.scan(f, jnp.zeros(HID), xs)
        return ys


def make(batch: int = 64):
    model = Forecaster(jax.random.PRNGKey(0))
    tx = optax.adabelief(1e-3)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    xs = jnp.ones((batch, T, F)); ys = jnp.zeros((batch, T, F))

    @eqx.filter_value_and_grad
    def loss_fn(model, xs, ys):
        return optax.huber_loss(jax.vmap(model)(xs), ys).mean()

    def step(model, opt_state, xs, ys):
        loss, grads = loss_fn(model, xs, ys)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss
    return step, (model, opt_state, xs, ys)
