"""Flax linen 3-level U-Net for segmentation: BatchNorm, max pooling, bilinear jax.image.resize upsampling and skip concatenations, trained with optax.lion on a per-pixel cross-entropy."""
import jax, jax.numpy as jnp, optax
import flax.linen as nn


class DoubleConv(nn.Module):
    c: int

    @nn.compact
    def __call__(self, x, train=True):
        for _ in range(2):
            x = nn.Conv(self.c, (3, 3), use_bias=False)(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train)(x))
        return x


class UNet(nn.Module):
    classes: int = 5

    @nn.compact
    def __call__(self, x, train=True):
        skips = []
        for c in (24, 48, 96):
            x = DoubleConv(c)(x, train); skips.append(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = DoubleConv(192)(x, train)
        for c, s in zip((96, 48, 24), reversed(skips)):
            b, h, w, _ = s.shape
            x = jax.image.resize(x, (b, h, w, x.shape[-1]), method='bilinear')
            x = DoubleConv(c)(jnp.concatenate([x, s], axis=-1), train)
        return nn.Conv(self.classes, (1, 1))(x)


def make(batch: int = 8):
    model = UNet()
    img = jnp.ones((batch, 96, 96, 3)); mask = jnp.zeros((batch, 96, 96), jnp.int32)
    v = model.init(jax.random.PRNGKey(0), img)
    tx = optax.lion(1e-4)
    opt_state = tx.init(v['params'])

    def step(params, batch_stats, opt_state, img, mask):
        def loss_fn(p):
            logits, mut = model.apply({'params': p, 'batch_stats': batch_stats}, img, mutable=['batch_stats'])
            return optax.softmax_cross_entropy_with_integer_labels(logits, mask).mean(), mut['batch_stats']
        (loss, bs), g = jax.value_and_grad(loss_fn, has_aux=True)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), bs, opt_state, loss
    return step, (v['params'], v['batch_stats'], opt_state, img, mask)
