"""GPT-2 small (124M) in Flax linen, f32, TrainState + AdamW with global-norm clipping, donated state, batch near TPU v5e HBM."""
import jax
import jax.numpy as jnp
import flax.linen as nn
import optax
from flax.training import train_state

DONATE = (0,)

VOCAB, CTX, WIDTH, HEADS, LAYERS = 50257, 1024, 768, 12, 12


class CausalSelfAttention(nn.Module):
    n_head: int
    @nn.compact
    def __call__(self, x):
        B, T, C = x.shape
        qkv = nn.Dense(3 * C, name="c_attn")(x)
        q, k, v = jnp.split(qkv, 3, axis=-1)
        split = lambda t: t.reshape(B, T, self.n_head, C // self.n_head).transpose(0, 2, 1, 3)
        q, k, v = split(q), split(k), split(v)
        att = (q @ k.transpose(0, 1, 3, 2)) * (1.0 / jnp.sqrt(C // self.n_head))
        mask = jnp.tril(jnp.ones((T, T), dtype=bool))
        att = jnp.where(mask[None, None], att, jnp.finfo(att.dtype).min)
        att = jax.nn.softmax(att, axis=-1)
        y = (att @ v).transpose(0, 2, 1, 3).reshape(B, T, C)
        return nn.Dense(C, name="c_proj")(y)


class Block(nn.Module):
    n_head: int
    @nn.compact
    def __call__(self, x):
        C = x.shape[-1]
        x = x + CausalSelfAttention(self.n_head)(nn.LayerNorm(epsilon=1e-5)(x))
        h = nn.LayerNorm(epsilon=1e-5)(x)
        h = nn.Dense(4 * C, name="c_fc")(h)
        h = nn.gelu(h, approximate=True)
        h = nn.Dense(C, name="c_proj")(h)
        return x + h


class GPT2(nn.Module):
    @nn.compact
    def __call__(self, idx):
        B, T = idx.shape
        wte = nn.Embed(VOCAB, WIDTH, name="wte")
        wpe = nn.Embed(CTX, WIDTH, name="wpe")
        x = wte(idx) + wpe(jnp.arange(T)[None])
        for i in range(LAYERS):
            x = Block(HEADS, name=f"h_{i}")(x)
        x = nn.LayerNorm(epsilon=1e-5, name="ln_f")(x)
        return wte.attend(x)


def train_step(state, tokens):
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def make(batch: int = 12):
    model = GPT2()
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(6e-4, b1=0.9, b2=0.95, weight_decay=0.1))

    def init():
        params = model.init(jax.random.key(0), jnp.zeros((1, CTX), jnp.int32))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    state = jax.eval_shape(init)
    tokens = jax.ShapeDtypeStruct((batch, CTX + 1), jnp.int32)
    return train_step, (state, tokens)
