"""Equinox ViT whose identical blocks are built with eqx.filter_vmap, split with eqx.partition and run by lax.scan over layers (the Equinox idiom for stacked layers), eqx.nn.MultiheadAttention, Adam."""
import jax, jax.numpy as jnp, equinox as eqx, optax
from jax import lax

D, H, L, P, IMG = 256, 8, 8, 4, 32
N = (IMG // P) ** 2


class Block(eqx.Module):
    ln1: eqx.nn.LayerNorm; attn: eqx.nn.MultiheadAttention
    ln2: eqx.nn.LayerNorm; fc1: eqx.nn.Linear; fc2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.ln1 = eqx.nn.LayerNorm(D); self.attn = eqx.nn.MultiheadAttention(H, D, key=k1)
        self.ln2 = eqx.nn.LayerNorm(D)
        self.fc1 = eqx.nn.Linear(D, 4 * D, key=k2); self.fc2 = eqx.nn.Linear(4 * D, D, key=k3)

    def __call__(self, x):
        y = jax.vmap(self.ln1)(x)
        x = x + self.attn(y, y, y)
        y = jax.vmap(self.ln2)(x)
        return x + jax.vmap(lambda t: self.fc2(jax.nn.gelu(self.fc1(t))))(y)


class ViT(eqx.Module):
    patch: eqx.nn.Conv2d; pos: jax.Array; blocks: Block; norm: eqx.nn.LayerNorm; head: eqx.nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.patch = eqx.nn.Conv2d(3, D, P, stride=P, key=k1)
        self.pos = jax.random.normal(k2, (N, D)) * 0.02
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(k3, L))
        self.norm = eqx.nn.LayerNorm(D); self.head = eqx.nn.Linear(D, 100, key=k4)

    def __call__(self, img):
        x = self.patch(img).reshape(D, N).T + self.pos
        dyn, static = eqx.partition(self.blocks, eqx.is_array)
        def body(x, blk):
            return eqx.combine(blk, static)(x), None
        x, _ = lax.scan(body, x, dyn)
        return self.head(self.norm(x.mean(0)))


def make(batch: int = 64):
    model = ViT(jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)   # plain jax.jit needs array-only arguments
    tx = optax.adam(1e-3)
    opt_state = tx.init(params)
    img = jnp.ones((batch, 3, IMG, IMG)); y = jnp.zeros((batch,), jnp.int32)

    def step(params, opt_state, img, y):
        @eqx.filter_value_and_grad
        def loss_fn(params):
            model = eqx.combine(params, static)
            return optax.softmax_cross_entropy_with_integer_labels(jax.vmap(model)(img), y).mean()
        loss, grads = loss_fn(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss
    return step, (params, opt_state, img, y)
