"""Flax linen MLP-Mixer with bfloat16 parameters and bfloat16 compute (param_dtype and dtype), token- and channel-mixing MLPs, Adam with bfloat16 first moments (mu_dtype)."""
import jax, jax.numpy as jnp, optax
import flax.linen as nn

BF = jnp.bfloat16


class MlpBlock(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.hidden, dtype=BF, param_dtype=BF)(x)
        return nn.Dense(x.shape[-1], dtype=BF, param_dtype=BF)(nn.gelu(y))


class Mixer(nn.Module):
    depth: int = 6; dim: int = 256; patch: int = 4; classes: int = 100

    @nn.compact
    def __call__(self, img):
        x = nn.Conv(self.dim, (self.patch, self.patch), strides=self.patch, dtype=BF, param_dtype=BF)(img)
        x = x.reshape(x.shape[0], -1, self.dim)
        for _ in range(self.depth):
            y = nn.LayerNorm(dtype=BF, param_dtype=BF)(x)
            x = x + MlpBlock(512)(y.swapaxes(1, 2)).swapaxes(1, 2)
            x = x + MlpBlock(1024)(nn.LayerNorm(dtype=BF, param_dtype=BF)(x))
        x = nn.LayerNorm(dtype=BF, param_dtype=BF)(x).mean(1)
        return nn.Dense(self.classes, dtype=BF, param_dtype=BF)(x)


def make(batch: int = 64):
    model = Mixer()
    img = jnp.ones((batch, 64, 64, 3), BF); y = jnp.zeros((batch,), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), img)['params']
    tx = optax.adam(1e-3, mu_dtype=BF)
    opt_state = tx.init(params)

    def step(params, opt_state, img, y):
        def loss_fn(p):
            logits = model.apply({'params': p}, img).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        loss, g = jax.value_and_grad(loss_fn)(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, upd), opt_state, loss
    return step, (params, opt_state, img, y)
