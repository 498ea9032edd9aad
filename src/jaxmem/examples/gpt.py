"""A GPT-style decoder-only transformer training step with Adam, in plain JAX (no flax, no optax).

The model `jaxmem analyze` plans when it is given no TARGET: token and position embeddings,
`n_layers` pre-norm blocks (layernorm, causal multi-head attention, an MLP with gelu), a final
layernorm, a tied or untied output head, softmax cross-entropy, `jax.value_and_grad`, and an
Adam update of the parameters and both moments.

    >>> fn, args = make_train_step(n_layers=1, d_model=32, n_heads=2, seq=8, batch=2, vocab=64)
    >>> params, opt_state, loss = fn(*args)
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.examples.adam import adam_state_midrun, adam_update
from jaxmem.examples.layers import causal_attention, cross_entropy, dense_init, gelu, layernorm, rmsnorm

Params = dict[str, Any]


def init_params(*, n_layers: int, d_model: int, n_heads: int, seq: int, vocab: int,
                d_ff: int | None = None, tied: bool = True, norm: str = "layernorm",
                seed: int = 0) -> Params:
    """Random float32 parameters for `forward`.

    >>> p = init_params(n_layers=2, d_model=16, n_heads=2, seq=4, vocab=32)
    >>> len(p["blocks"]), p["wte"].shape
    (2, (32, 16))

    Args:
        n_layers, d_model, n_heads, seq, vocab: the model's sizes (`n_heads` must divide `d_model`).
        d_ff: the MLP's hidden width (default 4 d_model).
        tied: reuse the token embedding as the output head (GPT-2) or keep a separate `w_head`.
        norm: "layernorm" (gain and bias) or "rmsnorm" (gain only).
        seed: numpy seed for the weights.

    Returns:
        A dict pytree; `blocks` is a list with one dict per layer.
    """
    if d_model % n_heads:
        raise ValueError(f"n_heads={n_heads} must divide d_model={d_model}")
    d_ff = d_ff or 4 * d_model
    rng = np.random.default_rng(seed)

    def norm_params() -> dict[str, jax.Array]:
        out = {"g": jnp.ones((d_model,), jnp.float32)}
        if norm == "layernorm":
            out["b"] = jnp.zeros((d_model,), jnp.float32)
        return out

    blocks = []
    for _ in range(n_layers):
        blocks.append({
            "ln1": norm_params(),
            "w_qkv": dense_init(rng, d_model, 3 * d_model),
            "b_qkv": jnp.zeros((3 * d_model,), jnp.float32),
            "w_o": dense_init(rng, d_model, d_model),
            "b_o": jnp.zeros((d_model,), jnp.float32),
            "ln2": norm_params(),
            "w_fc": dense_init(rng, d_model, d_ff),
            "b_fc": jnp.zeros((d_ff,), jnp.float32),
            "w_proj": dense_init(rng, d_ff, d_model),
            "b_proj": jnp.zeros((d_model,), jnp.float32),
        })
    params: Params = {
        "wte": jnp.asarray(0.02 * rng.standard_normal((vocab, d_model), dtype=np.float32)),
        "wpe": jnp.asarray(0.01 * rng.standard_normal((seq, d_model), dtype=np.float32)),
        "blocks": blocks,
        "ln_f": norm_params(),
    }
    if not tied:
        params["w_head"] = dense_init(rng, d_model, vocab)
    return params


def _norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    return layernorm(x, p["g"], p["b"]) if "b" in p else rmsnorm(x, p["g"])


def forward(params: Params, tokens: jax.Array, *, n_heads: int, exact_gelu: bool = False) -> jax.Array:
    """Logits (batch, seq, vocab) for integer tokens (batch, seq).

    >>> p = init_params(n_layers=1, d_model=16, n_heads=2, seq=4, vocab=32)
    >>> forward(p, jnp.zeros((3, 4), jnp.int32), n_heads=2).shape
    (3, 4, 32)
    """
    seq = tokens.shape[1]
    x = params["wte"][tokens] + params["wpe"][:seq]
    for block in params["blocks"]:
        h = _norm(x, block["ln1"])
        x = x + causal_attention(h, block["w_qkv"], block["b_qkv"], block["w_o"], block["b_o"], n_heads)
        h = _norm(x, block["ln2"])
        h = gelu(h @ block["w_fc"] + block["b_fc"], approximate=not exact_gelu)
        x = x + h @ block["w_proj"] + block["b_proj"]
    x = _norm(x, params["ln_f"])
    head = params["w_head"] if "w_head" in params else params["wte"].T
    return x @ head


def loss_fn(params: Params, batch: dict[str, jax.Array], *, n_heads: int, exact_gelu: bool = False) -> jax.Array:
    """Mean next-token cross-entropy of `batch = {"tokens", "targets"}`."""
    logits = forward(params, batch["tokens"], n_heads=n_heads, exact_gelu=exact_gelu)
    return cross_entropy(logits, batch["targets"])


def make_batch(*, batch: int, seq: int, vocab: int, seed: int = 1) -> dict[str, jax.Array]:
    """Random int32 `{"tokens", "targets"}` of shape (batch, seq), targets the tokens shifted by one."""
    rng = np.random.default_rng(seed)
    stream = rng.integers(0, vocab, size=(batch, seq + 1), dtype=np.int32)
    return {"tokens": jnp.asarray(stream[:, :-1]), "targets": jnp.asarray(stream[:, 1:])}


def make_train_step(*, n_layers: int = 4, d_model: int = 256, n_heads: int = 4, seq: int = 128,
                    batch: int = 8, vocab: int = 4096, d_ff: int | None = None, tied: bool = True,
                    norm: str = "layernorm", exact_gelu: bool = False, lr: float = 3e-4,
                    seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A GPT training step and arguments for it.

    >>> fn, (params, opt_state, batch) = make_train_step(n_layers=1, d_model=16, n_heads=2,
    ...                                                   seq=4, batch=2, vocab=32)
    >>> new_params, new_state, loss = fn(params, opt_state, batch)
    >>> int(new_state["step"])
    1001

    Args:
        n_layers, d_model, n_heads, seq, batch, vocab, d_ff, tied, norm: sizes and variants, see
            `init_params`.
        exact_gelu: erf gelu instead of the tanh approximation.
        lr: Adam's learning rate.
        seed: weights seed (the batch uses seed + 1).

    Returns:
        `(fn, (params, opt_state, batch))` where `fn(params, opt_state, batch)` returns
        `(new_params, new_opt_state, loss)`.
    """
    params = init_params(n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq=seq, vocab=vocab,
                         d_ff=d_ff, tied=tied, norm=norm, seed=seed)
    opt_state = adam_state_midrun(params)
    data = make_batch(batch=batch, seq=seq, vocab=vocab, seed=seed + 1)

    def train_step(params: Params, opt_state: dict[str, Any], batch: dict[str, jax.Array]):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, n_heads=n_heads, exact_gelu=exact_gelu)
        new_params, new_state = adam_update(params, grads, opt_state, lr=lr)
        return new_params, new_state, loss

    return train_step, (params, opt_state, data)


def make_forward(*, n_layers: int = 4, d_model: int = 256, n_heads: int = 4, seq: int = 128,
                 batch: int = 8, vocab: int = 4096, d_ff: int | None = None, tied: bool = True,
                 norm: str = "layernorm", exact_gelu: bool = False,
                 seed: int = 0) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The model's forward pass (loss only, no gradient) and arguments `(params, batch)`.

    >>> fn, args = make_forward(n_layers=1, d_model=16, n_heads=2, seq=4, batch=2, vocab=32)
    >>> fn(*args).shape
    ()
    """
    params = init_params(n_layers=n_layers, d_model=d_model, n_heads=n_heads, seq=seq, vocab=vocab,
                         d_ff=d_ff, tied=tied, norm=norm, seed=seed)
    data = make_batch(batch=batch, seq=seq, vocab=vocab, seed=seed + 1)

    def forward_loss(params: Params, batch: dict[str, jax.Array]) -> jax.Array:
        return loss_fn(params, batch, n_heads=n_heads, exact_gelu=exact_gelu)

    return forward_loss, (params, data)


def default_example() -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The training step `jaxmem analyze` plans without a TARGET: 4 layers, d_model 256, 4 heads,
    seq 128, batch 8, vocab 4096, tied head (about 4.2M parameters, 3 copies with Adam).

    >>> fn, args = default_example()
    >>> len(args)
    3
    """
    return make_train_step(n_layers=4, d_model=256, n_heads=4, seq=128, batch=8, vocab=4096)


def batch_example(batch_size: int = 8) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A GPT-2-small-sized training step with Adam (12 layers, d_model 768, 12 heads, seq 1024,
    vocab 50304, about 124M parameters) at `batch_size`, with `jax.ShapeDtypeStruct` arguments
    (nothing is allocated): `jaxmem maxbatch`'s example.

    >>> fn, (params, opt_state, batch) = batch_example(4)
    >>> batch["tokens"].shape
    (4, 1024)
    """
    holder: dict[str, Any] = {}

    def build() -> tuple[Any, ...]:
        fn, args = make_train_step(n_layers=12, d_model=768, n_heads=12, seq=1024, batch=batch_size, vocab=50304)
        holder["fn"] = fn
        return args

    args = jax.eval_shape(build)
    return holder["fn"], tuple(args)
