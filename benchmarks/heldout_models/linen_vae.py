"""Flax linen convolutional VAE: strided-conv encoder, reparameterised Gaussian latent (rngs={'noise'}), transposed-conv decoder, Bernoulli likelihood plus KL, Adam."""
import jax, jax.numpy as jnp, optax
import flax.linen as nn

LATENT = 64


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        for c in (32, 64, 128):
            x = nn.leaky_relu(nn.Conv(c, (4, 4), strides=(2, 2))(x))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(LATENT)(x), nn.Dense(LATENT)(x)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, z):
        x = nn.Dense(8 * 8 * 128)(z).reshape(z.shape[0], 8, 8, 128)
        for c in (64, 32):
            x = nn.leaky_relu(nn.ConvTranspose(c, (4, 4), strides=(2, 2))(x))
        return nn.ConvTranspose(3, (4, 4), strides=(2, 2))(x)


class VAE(nn.Module):
    @nn.compact
    def __call__(self, x):
        mean, logvar = Encoder()(x)
        eps = jax.random.normal(self.make_rng('noise'), mean.shape)
        z = mean + eps * jnp.exp(0.5 * logvar)
        return Decoder()(z), mean, logvar


def make(batch: int = 64):
    model = VAE()
    x = jnp.full((batch, 64, 64, 3), 0.5)
    params = model.init({'params': jax.random.PRNGKey(0), 'noise': jax.random.PRNGKey(1)}, x)['params']
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)
    rng = jax.random.PRNGKey(2)

    def train_step(params, opt_state, rng, x):
        rng, noise = jax.random.split(rng)
        def loss_fn(params):
            logits, mean, logvar = model.apply({'params': params}, x, rngs={'noise': noise})
            rec = optax.sigmoid_binary_cross_entropy(logits, x).sum((1, 2, 3)).mean()
            kl = -0.5 * jnp.sum(1 + logvar - mean ** 2 - jnp.exp(logvar), -1).mean()
            return rec + kl
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, rng, loss
    return train_step, (params, opt_state, rng, x)
