"""Equinox CNN with eqx.nn.Conv2d, eqx.nn.BatchNorm (state threaded through eqx.nn.State, vmapped with axis_name='batch'), eqx.nn.MaxPool2d and AvgPool2d, optax SGD-momentum, eqx.filter_value_and_grad."""
import jax, jax.numpy as jnp, equinox as eqx, optax


class CNN(eqx.Module):
    convs: list
    bns: list
    pool: eqx.nn.MaxPool2d
    head: eqx.nn.Linear

    def __init__(self, key):
        ks = jax.random.split(key, 5)
        ch = [3, 48, 96, 192]
        self.convs = [eqx.nn.Conv2d(a, b, 3, padding=1, key=k) for a, b, k in zip(ch[:-1], ch[1:], ks)]
        self.bns = [eqx.nn.BatchNorm(b, axis_name='batch', mode='batch') for b in ch[1:]]
        self.pool = eqx.nn.MaxPool2d(2, 2)
        self.head = eqx.nn.Linear(192, 10, key=ks[4])

    def __call__(self, x, state):
        for conv, bn in zip(self.convs, self.bns):
            x, state = bn(conv(x), state)
            x = self.pool(jax.nn.relu(x))
        x = eqx.nn.AvgPool2d(x.shape[-1])(x).reshape(-1)
        return self.head(x), state


def make(batch: int = 64):
    model, state = eqx.nn.make_with_state(CNN)(jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_inexact_array)   # plain jax.jit needs array-only arguments
    tx = optax.sgd(0.05, momentum=0.9)
    opt_state = tx.init(params)
    x = jnp.ones((batch, 3, 32, 32)); y = jnp.zeros((batch,), jnp.int32)

    def step(params, state, opt_state, x, y):
        def loss_fn(params, state):
            model = eqx.combine(params, static)
            logits, state = jax.vmap(model, axis_name='batch', in_axes=(0, None), out_axes=(0, None))(x, state)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state
        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(params, state)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), state, opt_state, loss
    return step, (params, state, opt_state, x, y)
