"""Linen MLP VAE on flattened 28x28 images (500 hidden, 37 latents), reparameterisation with a typed key argument, TrainState + Adam."""
import jax
import jax.numpy as jnp
import flax.linen as nn
import optax
from flax.training import train_state

LATENTS = 37


class Encoder(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(500, name="fc1")(x))
        return nn.Dense(LATENTS, name="fc2_mean")(x), nn.Dense(LATENTS, name="fc2_logvar")(x)


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, z):
        z = nn.relu(nn.Dense(500, name="fc1")(z))
        return nn.Dense(784, name="fc2")(z)


class VAE(nn.Module):
    def setup(self):
        self.encoder = Encoder()
        self.decoder = Decoder()

    def __call__(self, x, z_rng):
        mean, logvar = self.encoder(x)
        std = jnp.exp(0.5 * logvar)
        z = mean + std * jax.random.normal(z_rng, logvar.shape)
        return self.decoder(z), mean, logvar


def train_step(state, batch, z_rng):
    def loss_fn(params):
        logits, mean, logvar = state.apply_fn({"params": params}, batch, z_rng)
        bce = optax.sigmoid_binary_cross_entropy(logits, batch).sum(-1).mean()
        kld = (-0.5 * jnp.sum(1 + logvar - jnp.square(mean) - jnp.exp(logvar), -1)).mean()
        return bce + kld
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def make():
    model = VAE()
    key = jax.random.key(0)
    params = model.init(key, jnp.ones((1, 784)), jax.random.key(1))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    batch = (jax.random.uniform(jax.random.key(2), (512, 784)) > 0.5).astype(jnp.float32)
    return train_step, (state, batch, jax.random.key(3))
