import jax, jax.numpy as jnp, optax
from flax import linen as nn

class ConvBlock(nn.Module):
    c: int
    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.c, (3, 3))(x); x = nn.GroupNorm(num_groups=8)(x); x = nn.silu(x)
        x = nn.Conv(self.c, (3, 3))(x); x = nn.GroupNorm(num_groups=8)(x); return nn.silu(x)

class UNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        s1 = ConvBlock(32)(x)
        s2 = ConvBlock(64)(nn.max_pool(s1, (2, 2), (2, 2)))
        b = ConvBlock(128)(nn.max_pool(s2, (2, 2), (2, 2)))
        u2 = nn.ConvTranspose(64, (2, 2), strides=(2, 2))(b)
        u2 = ConvBlock(64)(jnp.concatenate([u2, s2], -1))
        u1 = nn.ConvTranspose(32, (2, 2), strides=(2, 2))(u2)
        u1 = ConvBlock(32)(jnp.concatenate([u1, s1], -1))
        return nn.Conv(1, (1, 1))(u1)

def make(batch: int = 8):
    m = UNet()
    x = jnp.ones((batch, 64, 64, 3)); y = jnp.zeros((batch, 64, 64, 1))
    params = m.init(jax.random.PRNGKey(0), x)
    tx = optax.adam(1e-3); opt = tx.init(params)
    def step(params, opt, x, y):
        loss, g = jax.value_and_grad(lambda p: jnp.mean((m.apply(p, x) - y) ** 2))(params)
        u, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, u), opt, loss
    return step, (params, opt, x, y)
