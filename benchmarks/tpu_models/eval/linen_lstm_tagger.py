"""Linen nn.RNN of LSTMCells (scan over time, 177 steps) for sequence tagging, plain params dict + optax RMSProp with clipping."""
import jax
import jax.numpy as jnp
import flax.linen as nn
import optax

VOCAB, EMB, HID, TAGS, T = 5003, 96, 211, 17, 177


class Tagger(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, EMB)(tokens)
        x = nn.RNN(nn.OptimizedLSTMCell(HID))(x)
        x = nn.RNN(nn.LSTMCell(HID), reverse=True, keep_order=True)(x)
        return nn.Dense(TAGS)(x)


model = Tagger()
tx = optax.chain(optax.clip_by_global_norm(5.0), optax.rmsprop(1e-3, momentum=0.9))


def train_step(params, opt_state, tokens, tags, mask):
    def loss_fn(p):
        logits = model.apply({"params": p}, tokens)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, tags)
        return jnp.sum(ce * mask) / jnp.maximum(mask.sum(), 1)
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def make():
    params = model.init(jax.random.key(0), jnp.zeros((1, T), jnp.int32))["params"]
    opt_state = tx.init(params)
    tokens = jax.random.randint(jax.random.key(1), (48, T), 0, VOCAB)
    tags = jax.random.randint(jax.random.key(2), (48, T), 0, TAGS)
    lengths = jax.random.randint(jax.random.key(3), (48, 1), 20, T)
    mask = jnp.arange(T)[None] < lengths
    return train_step, (params, opt_state, tokens, tags, mask)
