"""`jaxmem.analyze` of a 1.1B-parameter Llama-style training step that never exists in memory.

The parameters, the optimizer state and the batch are `jax.eval_shape` structures (nothing is
allocated); the step is jitted with donation and traced (`jax.stages.Traced`), then analysed
for a TPU v5e and for an H100. Prints, per device, XLA's figures, the verdict and the wall
time, and at the end the peak resident memory of this process and of its children (the
deviceless compiles), from `resource.getrusage`.

    JAX_PLATFORMS=cpu python benchmarks/bench_api_eval_shape.py
"""

from __future__ import annotations

import json
import resource
import sys
import time

import jax
import jax.numpy as jnp

import jaxmem

CONFIG = {"vocab": 32000, "d_model": 2048, "n_layers": 22, "n_heads": 32, "ffn": 5632, "batch": 2, "seq": 2048}


def init(key: jax.Array, c: dict[str, int]) -> dict[str, jax.Array]:
    """Llama-style parameters in bfloat16: embeddings, per layer attention and a SwiGLU MLP
    (stacked over layers, scanned), RMSNorm scales, an untied output head."""
    d, f, n = c["d_model"], c["ffn"], c["n_layers"]
    dense = lambda k, shape: (jax.random.normal(k, shape, jnp.float32) * 0.02).astype(jnp.bfloat16)  # noqa: E731
    ks = jax.random.split(key, 9)
    return {"embed": dense(ks[0], (c["vocab"], d)), "head": dense(ks[1], (d, c["vocab"])),
            "norm": jnp.ones((d,), jnp.bfloat16),
            "layers": {"wq": dense(ks[2], (n, d, d)), "wk": dense(ks[3], (n, d, d)), "wv": dense(ks[4], (n, d, d)),
                       "wo": dense(ks[5], (n, d, d)), "w1": dense(ks[6], (n, d, f)), "w3": dense(ks[7], (n, d, f)),
                       "w2": dense(ks[8], (n, f, d)), "ln1": jnp.ones((n, d), jnp.bfloat16),
                       "ln2": jnp.ones((n, d), jnp.bfloat16)}}


def rms(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(x.dtype) * scale


def block(x: jax.Array, p: dict[str, jax.Array], heads: int) -> jax.Array:
    b, s, d = x.shape
    h = rms(x, p["ln1"])
    q, k, v = (jnp.reshape(h @ p[w], (b, s, heads, d // heads)) for w in ("wq", "wk", "wv"))
    attn = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + jnp.reshape(attn, (b, s, d)) @ p["wo"]
    h = rms(x, p["ln2"])
    return x + (jax.nn.silu(h @ p["w1"]) * (h @ p["w3"])) @ p["w2"]


def loss(params: dict[str, jax.Array], tokens: jax.Array, heads: int) -> jax.Array:
    x = params["embed"][tokens[:, :-1]]
    x, _ = jax.lax.scan(lambda x, p: (block(x, p, heads), None), x, params["layers"])
    logits = (rms(x, params["norm"]) @ params["head"]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], -1))


def make_step(heads: int):
    """An Adam step (moments in bfloat16), parameters and moments updated in place."""
    def step(params: dict, opt: dict, tokens: jax.Array) -> tuple[dict, dict, jax.Array]:
        value, grads = jax.value_and_grad(loss)(params, tokens, heads)
        mu = jax.tree.map(lambda m, g: (0.9 * m + 0.1 * g).astype(m.dtype), opt["mu"], grads)
        nu = jax.tree.map(lambda v, g: (0.999 * v + 0.001 * g * g).astype(v.dtype), opt["nu"], grads)
        params = jax.tree.map(lambda p, m, v: (p - 1e-4 * m / (jnp.sqrt(v.astype(jnp.float32)) + 1e-8)).astype(p.dtype),
                              params, mu, nu)
        return params, {"mu": mu, "nu": nu}, value
    return step


def traced_step(c: dict[str, int]) -> tuple[jax.stages.Traced, int]:
    """The step traced on `jax.eval_shape` structures, and its parameter count."""
    params = jax.eval_shape(lambda: init(jax.random.key(0), c))
    opt = {"mu": params, "nu": params}
    tokens = jax.ShapeDtypeStruct((c["batch"], c["seq"] + 1), jnp.int32)
    count = sum(leaf.size for leaf in jax.tree.leaves(params))
    return jax.jit(make_step(c["n_heads"]), donate_argnums=(0, 1)).trace(params, opt, tokens), count


def peak_rss() -> dict[str, float]:
    """Peak resident memory (GiB) of this process and of its largest child (Linux: KiB)."""
    kib = 1 << 20
    return {"self_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / kib,
            "children_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / kib}


def main() -> int:
    started = time.perf_counter()
    traced, count = traced_step(CONFIG)
    rows = [{"params": count, "trace_seconds": round(time.perf_counter() - started, 2)}]
    for device in ("tpu-v5e-16gb", "h100-80gb"):
        t0 = time.perf_counter()
        result = jaxmem.analyze(traced, device=device)
        xla = result.xla or {}
        rows.append({"device": device, "fits": result.fits, "xla_total_bytes": xla.get("total_bytes"),
                     "xla_temp_bytes": xla.get("temp_bytes"), "oom": xla.get("oom"),
                     "plan_peak_bytes": result.plan.peak_bytes if result.plan is not None else None,
                     "cached": xla.get("cached"), "seconds": round(time.perf_counter() - t0, 1)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    rows.append({"wall_seconds": round(time.perf_counter() - started, 1), **peak_rss()})
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
