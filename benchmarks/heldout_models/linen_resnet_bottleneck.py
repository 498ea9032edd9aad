"""Flax linen ResNet with bottleneck blocks, strided 3x3 convs, BatchNorm and average pooling, trained with SGD-Nesterov plus decoupled weight decay (optax.chain)."""
import jax, jax.numpy as jnp, optax
import flax.linen as nn


class Bottleneck(nn.Module):
    filters: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool = True):
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)
        r = x
        y = nn.relu(norm()(nn.Conv(self.filters, (1, 1), use_bias=False)(x)))
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), strides=self.strides, use_bias=False)(y)))
        y = norm()(nn.Conv(self.filters * 4, (1, 1), use_bias=False)(y))
        if r.shape != y.shape:
            r = norm()(nn.Conv(self.filters * 4, (1, 1), strides=self.strides, use_bias=False)(r))
        return nn.relu(y + r)


class ResNet(nn.Module):
    stages: tuple = (2, 2, 2)
    classes: int = 100

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(64, (3, 3), use_bias=False)(x)))
        for i, n in enumerate(self.stages):
            for j in range(n):
                x = Bottleneck(32 * 2 ** i, strides=2 if (i > 0 and j == 0) else 1)(x, train)
        x = nn.avg_pool(x, (x.shape[1], x.shape[2]))
        return nn.Dense(self.classes)(x.reshape(x.shape[0], -1))


def make(batch: int = 32):
    model = ResNet()
    x = jnp.ones((batch, 32, 32, 3)); y = jnp.zeros((batch,), jnp.int32)
    variables = model.init(jax.random.PRNGKey(0), x)
    tx = optax.chain(optax.add_decayed_weights(5e-4), optax.sgd(0.1, momentum=0.9, nesterov=True))
    opt_state = tx.init(variables['params'])

    def train_step(params, batch_stats, opt_state, x, y):
        def loss_fn(params):
            logits, new_state = model.apply({'params': params, 'batch_stats': batch_stats}, x,
                                            mutable=['batch_stats'])
            loss = optax.softmax_cross_entropy(logits, jax.nn.one_hot(y, 100)).mean()
            return loss, new_state['batch_stats']
        (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss
    return train_step, (variables['params'], variables['batch_stats'], opt_state, x, y)
