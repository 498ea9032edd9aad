"""Building blocks the example models share, in plain JAX: norms, activations, attention, init.

Several variants on purpose (layernorm and RMSNorm, tanh and exact gelu, any head count), so that
the planner and the executor are not tuned to one model's shapes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def dense_init(rng: np.random.Generator, fan_in: int, fan_out: int) -> jax.Array:
    """A (fan_in, fan_out) float32 weight with scaled normal entries.

    >>> dense_init(np.random.default_rng(0), 4, 3).shape
    (4, 3)
    """
    w = rng.standard_normal((fan_in, fan_out), dtype=np.float32) / math.sqrt(fan_in)
    return jnp.asarray(w)


def layernorm(x: jax.Array, gain: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    """Layer normalization over the last axis.

    >>> layernorm(jnp.arange(4.0), jnp.ones(4), jnp.zeros(4)).shape
    (4,)
    """
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * gain + bias


def rmsnorm(x: jax.Array, gain: jax.Array, eps: float = 1e-6) -> jax.Array:
    """RMS normalization over the last axis (no mean subtraction, no bias).

    >>> rmsnorm(jnp.ones(4), jnp.ones(4)).shape
    (4,)
    """
    ms = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + eps) * gain


def gelu(x: jax.Array, approximate: bool = True) -> jax.Array:
    """GELU, tanh approximation (GPT-2) or exact (erf).

    >>> float(gelu(jnp.zeros(())))
    0.0
    """
    return jax.nn.gelu(x, approximate=approximate)


def causal_attention(x: jax.Array, w_qkv: jax.Array, b_qkv: jax.Array, w_o: jax.Array,
                     b_o: jax.Array, n_heads: int) -> jax.Array:
    """Causal multi-head self-attention of x: (batch, seq, d_model).

    >>> x = jnp.ones((1, 3, 4))
    >>> causal_attention(x, jnp.ones((4, 12)), jnp.zeros(12), jnp.ones((4, 4)), jnp.zeros(4), 2).shape
    (1, 3, 4)

    Args:
        x: activations, (batch, seq, d_model).
        w_qkv, b_qkv: the fused query/key/value projection, (d_model, 3 d_model) and (3 d_model,).
        w_o, b_o: the output projection.
        n_heads: number of heads; must divide d_model.

    Returns:
        (batch, seq, d_model).
    """
    batch, seq, d_model = x.shape
    head = d_model // n_heads
    qkv = x @ w_qkv + b_qkv
    q, k, v = jnp.split(qkv, 3, axis=-1)
    q = q.reshape(batch, seq, n_heads, head)
    k = k.reshape(batch, seq, n_heads, head)
    v = v.reshape(batch, seq, n_heads, head)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(head)
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, d_model)
    return out @ w_o + b_o


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer labels (take_along_axis, as optax does).

    >>> float(cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 1]))) == float(jnp.log(4.0))
    True
    """
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return -jnp.mean(picked)


def one_hot_cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy through a one-hot product (no gather), as many tutorials write it.

    >>> float(one_hot_cross_entropy(jnp.zeros((2, 4)), jnp.array([0, 1]))) == float(jnp.log(4.0))
    True
    """
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(targets, logits.shape[-1], dtype=logp.dtype) * logp, axis=-1))
