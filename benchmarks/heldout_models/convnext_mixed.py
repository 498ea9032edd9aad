"""Flax linen ConvNeXt-style net with float32 master params and bfloat16 compute (dtype=bfloat16): 7x7 depthwise convs (feature_group_count), LayerNorm, inverted-bottleneck MLP, layer scale, strided downsampling convs; AdamW."""
import jax, jax.numpy as jnp, optax
import flax.linen as nn

BF = jnp.bfloat16


class CNBlock(nn.Module):
    dim: int

    @nn.compact
    def __call__(self, x):
        r = x
        x = nn.Conv(self.dim, (7, 7), feature_group_count=self.dim, dtype=BF)(x)
        x = nn.LayerNorm(dtype=BF)(x)
        x = nn.Dense(4 * self.dim, dtype=BF)(x)
        x = nn.Dense(self.dim, dtype=BF)(nn.gelu(x))
        gamma = self.param('gamma', nn.initializers.constant(1e-6), (self.dim,))
        return r + (gamma * x).astype(r.dtype)


class ConvNeXt(nn.Module):
    dims: tuple = (64, 128, 256)
    depths: tuple = (2, 2, 4)

    @nn.compact
    def __call__(self, x):
        x = nn.Conv(self.dims[0], (4, 4), strides=4, dtype=BF)(x)
        for i, (d, n) in enumerate(zip(self.dims, self.depths)):
            if i:
                x = nn.Conv(d, (2, 2), strides=2, dtype=BF)(nn.LayerNorm(dtype=BF)(x))
            for _ in range(n):
                x = CNBlock(d)(x)
        return nn.Dense(200)(nn.LayerNorm()(x.mean((1, 2)).astype(jnp.float32)))


def make(batch: int = 32):
    model = ConvNeXt()
    x = jnp.ones((batch, 64, 64, 3)); y = jnp.zeros((batch,), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), x)['params']
    tx = optax.adamw(4e-3, weight_decay=0.05)
    opt_state = tx.init(params)

    def step(params, opt_state, x, y):
        def loss_fn(p):
            return optax.softmax_cross_entropy_with_integer_labels(model.apply({'params': p}, x), y).mean()
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss
    return step, (params, opt_state, x, y)
