"""Training steps written the way users write them today, for the GPU planner and fit.

Each is a plain-JAX model whose memory behaviour differs from the first suite's: a
mixture-of-experts layer that gathers per-token expert weights, attention through
`jax.nn.dot_product_attention`, layers stacked and run under `lax.scan` (with and without
`jax.checkpoint` on the body), a conv net with batch norm, bf16 compute over f32 master weights,
and a long sequence. Every step takes `(params, opt_state, batch)` and returns
`(loss, new_params, new_opt_state)` with Adam from a mid-run state (`adam_state_midrun`: from
zero moments Adam's first update is a sign function of rounding noise), so donating arguments
0 and 1 is the usual use.

>>> fn, args = moe_train(tokens=16, d_model=8, d_ff=16, experts=2)
>>> loss, params, state = jax.jit(fn)(*args)
>>> bool(jnp.isfinite(loss))
True
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.examples.adam import adam_state_midrun, adam_update
from jaxmem.examples.layers import dense_init, gelu, layernorm

Step = tuple[Callable[..., Any], tuple[Any, ...]]


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale)


def _train_step(loss_fn: Callable[[Any, Any], jax.Array]) -> Callable[..., Any]:
    def step(params: Any, opt_state: Any, batch: Any) -> tuple[jax.Array, Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        new_params, new_state = adam_update(params, grads, opt_state)
        return loss, new_params, new_state
    return step


# -- mixture of experts ---------------------------------------------------------------------------

def moe_train(tokens: int = 512, d_model: int = 128, d_ff: int = 256, experts: int = 8) -> Step:
    """Top-1 mixture-of-experts MLP: each token gathers its expert's weights (`w1[idx]`)."""
    rng = np.random.default_rng(0)
    params = {
        "router": dense_init(rng, d_model, experts),
        "w1": _normal(rng, (experts, d_model, d_ff), 1 / math.sqrt(d_model)),
        "w2": _normal(rng, (experts, d_ff, d_model), 1 / math.sqrt(d_ff)),
    }
    batch = (_normal(rng, (tokens, d_model)), _normal(rng, (tokens, d_model)))

    def loss_fn(p: Any, batch: Any) -> jax.Array:
        x, y = batch
        logits = x @ p["router"]
        idx = jnp.argmax(logits, axis=-1)
        gate = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), idx[:, None], axis=-1)
        h = gelu(jnp.einsum("td,tdf->tf", x, p["w1"][idx]))
        out = jnp.einsum("tf,tfd->td", h, p["w2"][idx]) * gate
        return jnp.mean(jnp.square(out - y))

    return _train_step(loss_fn), (params, adam_state_midrun(params), batch)


# -- transformers -----------------------------------------------------------------------------

def _block_params(rng: np.random.Generator, d_model: int, d_ff: int) -> dict[str, jax.Array]:
    return {
        "ln1": jnp.ones(d_model), "ln1_b": jnp.zeros(d_model),
        "qkv": dense_init(rng, d_model, 3 * d_model),
        "o": dense_init(rng, d_model, d_model),
        "ln2": jnp.ones(d_model), "ln2_b": jnp.zeros(d_model),
        "up": dense_init(rng, d_model, d_ff),
        "down": dense_init(rng, d_ff, d_model),
    }


def _block(p: dict[str, jax.Array], x: jax.Array, n_heads: int, dtype: Any) -> jax.Array:
    """A pre-norm transformer block; attention through `jax.nn.dot_product_attention` (XLA)."""
    b, s, d = x.shape
    h = layernorm(x, p["ln1"], p["ln1_b"]).astype(dtype)
    qkv = (h @ p["qkv"].astype(dtype)).reshape(b, s, 3, n_heads, d // n_heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    x = x + (attn.reshape(b, s, d) @ p["o"].astype(dtype)).astype(x.dtype)
    h = layernorm(x, p["ln2"], p["ln2_b"]).astype(dtype)
    return x + (gelu(h @ p["up"].astype(dtype)) @ p["down"].astype(dtype)).astype(x.dtype)


def _lm(n_layers: int, d_model: int, n_heads: int, seq: int, batch: int, vocab: int, *,
        scan: bool = False, checkpoint: bool = False, dtype: Any = jnp.float32) -> Step:
    rng = np.random.default_rng(1)
    layers = [_block_params(rng, d_model, 4 * d_model) for _ in range(n_layers)]
    params: dict[str, Any] = {
        "embed": _normal(rng, (vocab, d_model), 0.02),
        "ln_f": jnp.ones(d_model), "ln_f_b": jnp.zeros(d_model),
        "layers": jax.tree.map(lambda *xs: jnp.stack(xs), *layers) if scan else layers,
    }
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)

    def layer(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        return _block(p, x, n_heads, dtype)

    body = jax.checkpoint(layer) if checkpoint else layer

    def loss_fn(p: Any, tokens: jax.Array) -> jax.Array:
        x = p["embed"][tokens[:, :-1]]
        if scan:
            x, _ = jax.lax.scan(lambda c, lp: (body(c, lp), None), x, p["layers"])
        else:
            for lp in p["layers"]:
                x = body(x, lp)
        x = layernorm(x, p["ln_f"], p["ln_f_b"])
        logits = (x.astype(dtype) @ p["embed"].T.astype(dtype)).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return _train_step(loss_fn), (params, adam_state_midrun(params), tokens)


def attention_train() -> Step:
    """Transformer step, attention by `jax.nn.dot_product_attention`: 4 layers, d 256, seq 256."""
    return _lm(4, 256, 8, seq=256, batch=4, vocab=4096)


def scanned_transformer_train() -> Step:
    """Transformer step with its 8 layers stacked and run under `lax.scan`: d 256, seq 256."""
    return _lm(8, 256, 8, seq=256, batch=4, vocab=4096, scan=True)


def scanned_checkpoint_train() -> Step:
    """The scanned transformer step with `jax.checkpoint` on the scan body (MaxText's default)."""
    return _lm(8, 256, 8, seq=256, batch=4, vocab=4096, scan=True, checkpoint=True)


def bf16_train() -> Step:
    """Mixed precision: bf16 matmuls and activations over f32 master weights and Adam state."""
    return _lm(4, 384, 6, seq=256, batch=4, vocab=8192, dtype=jnp.bfloat16)


def long_seq_train() -> Step:
    """Long sequence: 2 layers, d 128, seq 2048, batch 1, where attention scores dominate."""
    return _lm(2, 128, 4, seq=2048, batch=1, vocab=4096)


# -- conv net with batch norm -----------------------------------------------------------------

def _batchnorm(x: jax.Array, gain: jax.Array, bias: jax.Array, eps: float = 1e-5) -> jax.Array:
    mean = jnp.mean(x, axis=(0, 1, 2))
    var = jnp.var(x, axis=(0, 1, 2))
    return (x - mean) * jax.lax.rsqrt(var + eps) * gain + bias


def convnet_bn_train(batch: int = 64, size: int = 32, widths: tuple[int, ...] = (32, 64, 128),
                     classes: int = 10) -> Step:
    """Conv net with batch norm (batch statistics), relu and 2x2 pooling per stage, NHWC."""
    rng = np.random.default_rng(2)
    params: dict[str, Any] = {"convs": [], "head": None}
    c_in = 3
    for c in widths:
        params["convs"].append({
            "w": _normal(rng, (3, 3, c_in, c), math.sqrt(2 / (9 * c_in))),
            "gain": jnp.ones(c), "bias": jnp.zeros(c)})
        c_in = c
    params["head"] = dense_init(rng, c_in, classes)
    images = _normal(rng, (batch, size, size, 3))
    labels = jnp.asarray(rng.integers(0, classes, batch), jnp.int32)

    def loss_fn(p: Any, batch: Any) -> jax.Array:
        x, y = batch
        for conv in p["convs"]:
            x = jax.lax.conv_general_dilated(x, conv["w"], (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = jax.nn.relu(_batchnorm(x, conv["gain"], conv["bias"]))
            x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        logits = jnp.mean(x, axis=(1, 2)) @ p["head"]
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=-1))

    return _train_step(loss_fn), (params, adam_state_midrun(params), (images, labels))
