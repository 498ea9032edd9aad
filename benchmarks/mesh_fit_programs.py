"""Sharded training steps for `bench_fit_mesh.py`, none of them tuned on: each is `(step, structs)`
where `structs(mesh, batch)` gives the step's arguments as `ShapeDtypeStruct`s sharded over
`mesh` (an `AbstractMesh` for jaxmem, a topology's `Mesh` for JAX's own AOT compile).

- decoder: a Llama-style decoder (GQA, SwiGLU, RMSNorm, scanned layers, bf16 parameters, Adam
  moments in f32) under FSDP over 8 chips.
- moe: a decoder whose feed-forward is 8 experts with top-2 routing (dense dispatch), scanned, the
  experts sharded over "data".
- loop: an MLP stack of 12 layers called from a Python loop (no scan), FSDP.
- tensor_parallel: scanned MLP layers on a 4x2 mesh, each weight split over "model" as Megatron
  splits it (the first matmul's columns, the second's rows), the batch over "data".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

SEQ = 2048


def _sds(mesh, shape, spec, dtype=jnp.bfloat16):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def _adam(params, grads, m, v):
    m = jax.tree.map(lambda a, g: 0.9 * a + 0.1 * g.astype(jnp.float32), m, grads)
    v = jax.tree.map(lambda a, g: 0.999 * a + 0.001 * jnp.square(g.astype(jnp.float32)), v, grads)
    params = jax.tree.map(lambda p, a, b: (p - 1e-4 * a / (jnp.sqrt(b) + 1e-8)).astype(p.dtype), params, m, v)
    return params, m, v


def _rms(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


# -- decoder -----------------------------------------------------------------------------------

D_LAYERS, D, HEADS, KV, HEAD, FF, VOCAB = 12, 2048, 16, 4, 128, 5632, 32000


def _attention(h, w):
    b, s, _ = h.shape
    q = (h @ w["q"]).reshape(b, s, HEADS, HEAD)
    k = (h @ w["k"]).reshape(b, s, KV, HEAD)
    v = (h @ w["v"]).reshape(b, s, KV, HEAD)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return out.reshape(b, s, HEADS * HEAD) @ w["o"]


def _swiglu(h, w):
    return (jax.nn.silu(h @ w["gate"]) * (h @ w["up"])) @ w["down"]


def decoder_step(state, tokens):
    params, m, v = state

    def loss(params):
        h = params["embed"][tokens[:, :-1]]

        def layer(h, w):
            h = h + _attention(_rms(h), w)
            return h + _swiglu(_rms(h), w), None

        h, _ = jax.lax.scan(layer, h, params["layers"])
        logits = (_rms(h) @ params["embed"].T).astype(jnp.float32)
        labels = tokens[:, 1:]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1))

    grads = jax.grad(loss)(params)
    return _adam(params, grads, m, v)


def decoder_structs(mesh, batch):
    shapes = {"q": (D, HEADS * HEAD), "k": (D, KV * HEAD), "v": (D, KV * HEAD), "o": (HEADS * HEAD, D),
              "gate": (D, FF), "up": (D, FF), "down": (FF, D)}

    def tree(dtype):
        layers = {k: _sds(mesh, (D_LAYERS,) + s, P(None, "data", None), dtype) for k, s in shapes.items()}
        return {"embed": _sds(mesh, (VOCAB, D), P("data", None), dtype), "layers": layers}

    state = (tree(jnp.bfloat16), tree(jnp.float32), tree(jnp.float32))
    return state, _sds(mesh, (batch, SEQ + 1), P("data", None), jnp.int32)


# -- mixture of experts ------------------------------------------------------------------------

M_LAYERS, M_D, EXPERTS, TOP, M_FF = 8, 1024, 8, 2, 4096


def moe_step(state, x):
    params, m, v = state

    def loss(params):
        def layer(h, w):
            a = _rms(h)
            gates = jax.nn.softmax((a @ w["router"]).astype(jnp.float32), axis=-1)
            top, idx = jax.lax.top_k(gates, TOP)
            weights = jnp.sum(jax.nn.one_hot(idx, EXPERTS) * top[..., None], axis=-2).astype(h.dtype)
            hidden = jax.nn.gelu(jnp.einsum("bsd,edf->bsef", a, w["w_in"]))
            out = jnp.einsum("bsef,efd->bsed", hidden, w["w_out"])
            return h + jnp.einsum("bsed,bse->bsd", out, weights), None

        h, _ = jax.lax.scan(layer, x, params)
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    grads = jax.grad(loss)(params)
    return _adam(params, grads, m, v)


def moe_structs(mesh, batch):
    def tree(dtype):
        return {"router": _sds(mesh, (M_LAYERS, M_D, EXPERTS), P(), dtype),
                "w_in": _sds(mesh, (M_LAYERS, EXPERTS, M_D, M_FF), P(None, "data", None, None), dtype),
                "w_out": _sds(mesh, (M_LAYERS, EXPERTS, M_FF, M_D), P(None, "data", None, None), dtype)}

    return (tree(jnp.bfloat16), tree(jnp.float32), tree(jnp.float32)), _sds(mesh, (batch, 1024, M_D), P("data"))


# -- a Python loop of layers -------------------------------------------------------------------

L_LAYERS, L_D, L_FF = 12, 2048, 8192


def _block(h, w1, w2):
    return h + jax.nn.gelu(_rms(h) @ w1) @ w2


def loop_step(params, x):
    def loss(params):
        h = x
        for w1, w2 in zip(params["w1"], params["w2"]):
            h = _block(h, w1, w2)
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


def loop_structs(mesh, batch):
    params = {"w1": [_sds(mesh, (L_D, L_FF), P("data", None)) for _ in range(L_LAYERS)],
              "w2": [_sds(mesh, (L_FF, L_D), P(None, "data")) for _ in range(L_LAYERS)]}
    return params, _sds(mesh, (batch, 1024, L_D), P("data"))


# -- tensor parallel ---------------------------------------------------------------------------

T_LAYERS, T_D, T_FF = 16, 4096, 16384


def tp_step(params, x):
    def loss(params):
        def layer(h, w):
            return h + jax.nn.gelu(_rms(h) @ w[0]) @ w[1], None

        h, _ = jax.lax.scan(layer, x, (params["w1"], params["w2"]))
        return jnp.mean(jnp.square(h.astype(jnp.float32)))

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)


def tp_structs(mesh, batch):
    params = {"w1": _sds(mesh, (T_LAYERS, T_D, T_FF), P(None, None, "model")),
              "w2": _sds(mesh, (T_LAYERS, T_FF, T_D), P(None, "model", None))}
    return params, _sds(mesh, (batch, 1024, T_D), P("data"))


# name -> (step, structs, mesh axis sizes, names, donated positions)
PROGRAMS = {
    "decoder": (decoder_step, decoder_structs, (8,), ("data",), (0,)),
    "moe": (moe_step, moe_structs, (8,), ("data",), (0,)),
    "loop": (loop_step, loop_structs, (8,), ("data",), (0,)),
    "tensor_parallel": (tp_step, tp_structs, (4, 2), ("data", "model"), (0,)),
}


# -- a 70B-parameter decoder on a v5e-256 slice ------------------------------------------------

B_LAYERS, B_D, B_HEADS, B_KV, B_FF = 80, 8192, 64, 8, 28672


def big_decoder_step(state, tokens):
    """A Llama-2-70B-shaped step: 80 scanned layers each under `jax.checkpoint`, GQA (64 query,
    8 key/value heads), SwiGLU, bf16 parameters and Adam moments, FSDP over every chip."""
    params, m, v = state

    def loss(params):
        h = params["embed"][tokens[:, :-1]]

        @jax.checkpoint
        def layer(h, w):
            b, s, _ = h.shape
            a = _rms(h)
            q = (a @ w["q"]).reshape(b, s, B_HEADS, HEAD)
            k = (a @ w["k"]).reshape(b, s, B_KV, HEAD)
            val = (a @ w["v"]).reshape(b, s, B_KV, HEAD)
            h = h + jax.nn.dot_product_attention(q, k, val, is_causal=True).reshape(b, s, -1) @ w["o"]
            a = _rms(h)
            return h + (jax.nn.silu(a @ w["gate"]) * (a @ w["up"])) @ w["down"], None

        h, _ = jax.lax.scan(layer, h, params["layers"])
        logits = (_rms(h) @ params["embed"].T).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))

    grads = jax.grad(loss)(params)
    m = jax.tree.map(lambda a, g: (0.9 * a + 0.1 * g).astype(a.dtype), m, grads)
    v = jax.tree.map(lambda a, g: (0.999 * a + 0.001 * g * g).astype(a.dtype), v, grads)
    params = jax.tree.map(lambda p, a, b: (p - 1e-4 * a / (jnp.sqrt(b) + 1e-8)).astype(p.dtype), params, m, v)
    return params, m, v


def big_decoder_structs(mesh, batch):
    shapes = {"q": (B_D, B_HEADS * HEAD), "k": (B_D, B_KV * HEAD), "v": (B_D, B_KV * HEAD),
              "o": (B_HEADS * HEAD, B_D), "gate": (B_D, B_FF), "up": (B_D, B_FF), "down": (B_FF, B_D)}

    def tree():
        layers = {k: _sds(mesh, (B_LAYERS,) + s, P(None, "data", None)) for k, s in shapes.items()}
        return {"embed": _sds(mesh, (VOCAB, B_D), P("data", None)), "layers": layers}

    return (tree(), tree(), tree()), _sds(mesh, (batch, SEQ + 1), P("data", None), jnp.int32)


BIG = {"llama70b": (big_decoder_step, big_decoder_structs, (256,), ("data",), (0,))}


# -- the decoder on 64 H100s (8 nodes of 8): FSDP over "data", tensor parallel over "model" -----

def gpu_decoder_structs(mesh, batch):
    shapes = {"q": (D, HEADS * HEAD), "k": (D, KV * HEAD), "v": (D, KV * HEAD), "o": (HEADS * HEAD, D),
              "gate": (D, FF), "up": (D, FF), "down": (FF, D)}
    split = {"q": P(None, "data", "model"), "k": P(None, "data", None), "v": P(None, "data", None),
             "o": P(None, "model", "data"), "gate": P(None, "data", "model"), "up": P(None, "data", "model"),
             "down": P(None, "model", "data")}

    def tree(dtype):
        layers = {k: _sds(mesh, (D_LAYERS,) + s, split[k], dtype) for k, s in shapes.items()}
        return {"embed": _sds(mesh, (VOCAB, D), P("data", "model"), dtype), "layers": layers}

    state = (tree(jnp.bfloat16), tree(jnp.float32), tree(jnp.float32))
    return state, _sds(mesh, (batch, SEQ + 1), P("data", None), jnp.int32)


PROGRAMS["gpu64_decoder"] = (decoder_step, gpu_decoder_structs, (8, 8), ("data", "model"), (0,))
DEVICE = {"gpu64_decoder": "h100-80gb", "llama70b": "tpu-v5e-16gb"}
