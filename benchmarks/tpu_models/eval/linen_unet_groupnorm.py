"""Small linen U-Net for segmentation with GroupNorm, ConvTranspose upsampling, odd channels (3->24->48->96), 5 classes, AdamW."""
import jax
import jax.numpy as jnp
import flax.linen as nn
import optax


class ConvBlock(nn.Module):
    features: int
    @nn.compact
    def __call__(self, x):
        for _ in range(2):
            x = nn.Conv(self.features, (3, 3))(x)
            x = nn.GroupNorm(num_groups=8)(x)
            x = nn.swish(x)
        return x


class UNet(nn.Module):
    classes: int = 5
    @nn.compact
    def __call__(self, x):
        skips = []
        for f in (24, 48):
            x = ConvBlock(f)(x)
            skips.append(x)
            x = nn.max_pool(x, (2, 2), strides=(2, 2))
        x = ConvBlock(96)(x)
        for f, skip in zip((48, 24), reversed(skips)):
            x = nn.ConvTranspose(f, (2, 2), strides=(2, 2))(x)
            x = jnp.concatenate([x, skip], axis=-1)
            x = ConvBlock(f)(x)
        return nn.Conv(self.classes, (1, 1))(x)


model = UNet()
tx = optax.adamw(2e-4, weight_decay=1e-4)


def train_step(state, images, masks):
    params, opt_state = state
    def loss_fn(p):
        logits = model.apply({"params": p}, images)
        return optax.softmax_cross_entropy_with_integer_labels(logits, masks).mean()
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


def make():
    params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 96, 96, 3)))["params"]
    images = jax.random.normal(jax.random.key(1), (16, 96, 96, 3))
    masks = jax.random.randint(jax.random.key(2), (16, 96, 96), 0, 5)
    return train_step, ((params, tx.init(params)), images, masks)
