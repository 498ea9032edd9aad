"""Equinox CNN with eqx.nn.Conv2d (odd channels 3->17->33), static fields, eqx.filter partition step with Adam."""
import equinox as eqx
import jax
import jax.numpy as jnp
import optax


class ConvNet(eqx.Module):
    convs: list
    head: eqx.nn.Linear
    pool: eqx.nn.MaxPool2d
    num_classes: int = eqx.field(static=True)
    activation: callable = eqx.field(static=True)

    def __init__(self, num_classes, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.convs = [eqx.nn.Conv2d(3, 17, 3, padding=1, key=k1),
                      eqx.nn.Conv2d(17, 33, 3, padding=1, key=k2),
                      eqx.nn.Conv2d(33, 33, 3, padding=1, key=k3)]
        self.pool = eqx.nn.MaxPool2d(2, 2)
        self.head = eqx.nn.Linear(33, num_classes, key=k4)
        self.num_classes = num_classes
        self.activation = jax.nn.gelu

    def __call__(self, x):  # x: (C, H, W) -- Equinox convs are unbatched, channels-first
        for conv in self.convs:
            x = self.pool(self.activation(conv(x)))
        return self.head(jnp.mean(x, axis=(1, 2)))


optim = optax.adam(3e-4)


def make():
    model = ConvNet(11, jax.random.key(0))
    params, static = eqx.partition(model, eqx.is_array)
    opt_state = optim.init(params)

    def train_step(params, opt_state, x, y):
        def loss_fn(params):
            model = eqx.combine(params, static)
            logits = jax.vmap(model)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optim.update(grads, opt_state, params)
        params = eqx.apply_updates(params, updates)
        return params, opt_state, loss

    x = jax.random.normal(jax.random.key(1), (96, 3, 64, 64))
    y = jax.random.randint(jax.random.key(2), (96,), 0, 11)
    return train_step, (params, opt_state, x, y)
