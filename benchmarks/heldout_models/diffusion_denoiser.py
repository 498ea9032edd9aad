"""DDPM-style denoiser training step in Flax linen: random timesteps, cosine noise schedule, sinusoidal time embedding injected by FiLM into a small residual U-Net with GroupNorm, avg-pool downsampling and nearest upsampling, epsilon-prediction MSE, AdamW and an EMA of the weights."""
import math
import jax, jax.numpy as jnp, optax
import flax.linen as nn


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half) / half)
    a = t[:, None].astype(jnp.float32) * freqs[None]
    return jnp.concatenate([jnp.sin(a), jnp.cos(a)], -1)


class ResBlock(nn.Module):
    c: int

    @nn.compact
    def __call__(self, x, temb):
        h = nn.Conv(self.c, (3, 3))(nn.swish(nn.GroupNorm(8)(x)))
        scale, shift = jnp.split(nn.Dense(2 * self.c)(nn.swish(temb)), 2, -1)
        h = nn.GroupNorm(8)(h) * (1 + scale[:, None, None]) + shift[:, None, None]
        h = nn.Conv(self.c, (3, 3))(nn.swish(h))
        if x.shape[-1] != self.c:
            x = nn.Conv(self.c, (1, 1))(x)
        return x + h


class Denoiser(nn.Module):
    @nn.compact
    def __call__(self, x, t):
        temb = nn.Dense(256)(nn.swish(nn.Dense(256)(timestep_embedding(t, 64))))
        h = nn.Conv(32, (3, 3))(x)
        h1 = ResBlock(32)(h, temb)
        h2 = ResBlock(64)(nn.avg_pool(h1, (2, 2), (2, 2)), temb)
        h3 = ResBlock(128)(nn.avg_pool(h2, (2, 2), (2, 2)), temb)
        u = jnp.repeat(jnp.repeat(h3, 2, 1), 2, 2)
        u = ResBlock(64)(jnp.concatenate([u, h2], -1), temb)
        u = jnp.repeat(jnp.repeat(u, 2, 1), 2, 2)
        u = ResBlock(32)(jnp.concatenate([u, h1], -1), temb)
        return nn.Conv(3, (3, 3))(nn.swish(nn.GroupNorm(8)(u)))


def make(batch: int = 32):
    model = Denoiser()
    x0 = jnp.zeros((batch, 32, 32, 3))
    params = model.init(jax.random.PRNGKey(0), x0, jnp.zeros((batch,), jnp.int32))['params']
    ema = params
    tx = optax.adamw(2e-4, weight_decay=0.0)
    opt_state = tx.init(params)
    key = jax.random.PRNGKey(1)
    T = 1000

    def train_step(params, ema, opt_state, key, x0):
        key, kt, kn = jax.random.split(key, 3)
        t = jax.random.randint(kt, (x0.shape[0],), 0, T)
        abar = jnp.cos((t / T + 0.008) / 1.008 * jnp.pi / 2) ** 2
        noise = jax.random.normal(kn, x0.shape)
        xt = jnp.sqrt(abar)[:, None, None, None] * x0 + jnp.sqrt(1 - abar)[:, None, None, None] * noise
        def loss_fn(p):
            return jnp.mean((model.apply({'params': p}, xt, t) - noise) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        ema = optax.incremental_update(params, ema, 1 - 0.999)
        return params, ema, opt_state, key, loss
    return train_step, (params, ema, opt_state, key, x0)
