"""Equinox eqx.nn.MLP (widths 300, depth 4) inside a module with static fields, eqx.filter/eqx.filter_value_and_grad, optax AdaBelief."""
import equinox as eqx
import jax
import jax.numpy as jnp
import optax


class Regressor(eqx.Module):
    mlp: eqx.nn.MLP
    norm: eqx.nn.LayerNorm
    out_scale: float = eqx.field(static=True)
    name: str = eqx.field(static=True)

    def __init__(self, key):
        self.mlp = eqx.nn.MLP(in_size=123, out_size=5, width_size=300, depth=4, activation=jax.nn.softplus, key=key)
        self.norm = eqx.nn.LayerNorm(123)
        self.out_scale = 0.5
        self.name = "regressor"

    def __call__(self, x):
        return self.out_scale * self.mlp(self.norm(x))


optim = optax.adabelief(2e-3)


def make():
    model = Regressor(jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = optim.init(eqx.filter(model, eqx.is_array))

    def train_step(params, opt_state, x, y):
        model = eqx.combine(params, static)

        @eqx.filter_value_and_grad
        def loss_fn(model):
            return jnp.mean(optax.huber_loss(jax.vmap(model)(x), y))

        loss, grads = loss_fn(model)
        updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        model = eqx.apply_updates(model, updates)
        return eqx.filter(model, eqx.is_array), opt_state, loss

    x = jax.random.normal(jax.random.key(1), (4096, 123))
    y = jax.random.normal(jax.random.key(2), (4096, 5))
    return train_step, (params, opt_state, x, y)
