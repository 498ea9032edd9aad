"""Small char-level causal transformer LM in linen (vocab 77, width 300, 5 heads), TrainState + AdamW with clipping."""
import jax
import jax.numpy as jnp
import flax.linen as nn
import optax
from flax.training import train_state

VOCAB, SEQ, D, HEADS, LAYERS = 77, 256, 300, 5, 4


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        h = nn.SelfAttention(num_heads=HEADS, qkv_features=D, dropout_rate=0.0, deterministic=True)(h, mask=mask)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.Dense(4 * D)(h)
        h = nn.gelu(h)
        return x + nn.Dense(D)(h)


class CharLM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        pos = self.param("pos", nn.initializers.normal(0.02), (SEQ, D))
        x = x + pos[: tokens.shape[1]]
        mask = nn.make_causal_mask(tokens)
        for _ in range(LAYERS):
            x = Block()(x, mask)
        x = nn.LayerNorm()(x)
        return nn.Dense(VOCAB)(x)


@jax.jit
def train_step(state, batch):
    inputs, targets = batch[:, :-1], batch[:, 1:]
    def loss_fn(params):
        logits = state.apply_fn({"params": params}, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def make():
    model = CharLM()
    params = model.init(jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.01))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    batch = jax.random.randint(jax.random.key(1), (32, SEQ + 1), 0, VOCAB)
    return train_step, (state, batch)
