"""Plain JAX Elman RNN LM via lax.scan, NamedTuple train state holding params, opt state, a typed PRNG key and step; dropout from the key."""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

VOCAB, EMB, HID, T = 1000, 77, 513, 128


class TrainState(NamedTuple):
    params: dict
    opt_state: optax.OptState
    key: jax.Array
    step: jax.Array


def init_params(key):
    k = jax.random.split(key, 4)
    return {"embed": jax.random.normal(k[0], (VOCAB, EMB)) * 0.02,
            "W_xh": jax.random.normal(k[1], (EMB, HID)) / jnp.sqrt(EMB),
            "W_hh": jax.random.normal(k[2], (HID, HID)) / jnp.sqrt(HID),
            "b_h": jnp.zeros((HID,)),
            "W_hy": jax.random.normal(k[3], (HID, VOCAB)) / jnp.sqrt(HID),
            "b_y": jnp.zeros((VOCAB,))}


def rnn_logits(params, tokens, dropout_key, rate=0.2):
    x = params["embed"][tokens]  # (B, T, E)
    keep = jax.random.bernoulli(dropout_key, 1 - rate, x.shape)
    x = jnp.where(keep, x / (1 - rate), 0.0)
    def step(h, x_t):
        h = jnp.tanh(x_t @ params["W_xh"] + h @ params["W_hh"] + params["b_h"])
        return h, h
    h0 = jnp.zeros((tokens.shape[0], HID))
    _, hs = jax.lax.scan(step, h0, jnp.swapaxes(x, 0, 1))
    return jnp.swapaxes(hs, 0, 1) @ params["W_hy"] + params["b_y"]


optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(2e-3))


def train_step(state: TrainState, tokens):
    key, dropout_key = jax.random.split(state.key)
    def loss_fn(params):
        logits = rnn_logits(params, tokens[:, :-1], dropout_key)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return TrainState(params, opt_state, key, state.step + 1), loss


def make():
    params = init_params(jax.random.key(0))
    state = TrainState(params, optimizer.init(params), jax.random.key(42), jnp.array(0, jnp.int32))
    tokens = jax.random.randint(jax.random.key(1), (64, T + 1), 0, VOCAB)
    return train_step, (state, tokens)
