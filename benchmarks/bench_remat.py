"""Rematerialization benchmark: jaxmem.fit on 12-layer training steps at 70%, 50%, 35% budgets.

Three models written here so their layers can be wrapped: a deep residual MLP (each layer
x + W2 tanh(W1 x), hidden 4x wide), a plain 16-layer MLP (gelu(x W + b)), and a pre-norm
transformer (attention + gelu MLP). For each,
the original step, `jax.checkpoint` around every layer, and `jax.checkpoint` with the
`dots_saveable` policy are compiled by XLA on this machine's backend; then `jaxmem.fit` is run
at budgets of 70%, 50% and 35% of XLA's total for the original. Every figure is XLA's own
`memory_analysis()` (argument + output + temp - alias) or jaxmem's plan; FLOPs are counted on
the jaxpr (`jaxmem.compiler.costs`), so a checkpoint policy's recompute is what its jaxpr asks
for, whether or not XLA later merges it away.

    .venv/bin/python benchmarks/bench_remat.py            # full size, 12 layers
    .venv/bin/python benchmarks/bench_remat.py --small    # a quick run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.fitting.fit import fit
from jaxmem.compiler.remat_graph import trace
from jaxmem.compiler.remat_search import program_flops
from jaxmem.units import format_size
from jaxmem.xla.cpu.compile import xla_reference


def _sgd(loss: Callable) -> Callable:
    def step(params: Any, batch: Any) -> Any:
        value, grads = jax.value_and_grad(loss)(params, batch)
        return value, jax.tree.map(lambda p, g: p - 1e-3 * g, params, grads)
    return step


def _stacked_mse_step(layer: Callable) -> Callable:
    """make_step(wrap): an SGD step of `layer` applied once per parameter set, mean-squared error."""
    def make(wrap: Callable) -> Callable:
        f = wrap(layer)

        def loss(params: Any, batch: Any) -> jax.Array:
            h = batch["x"]
            for p in params:
                h = f(h, p)
            return jnp.mean((h - batch["y"]) ** 2)
        return _sgd(loss)
    return make


def mlp_model(layers: int, batch: int, width: int) -> tuple[Callable, Callable, Any]:
    """(make_step(wrap), params/batch) for a residual MLP; `wrap` wraps each layer function."""
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * layers)
    params = [{"w1": jax.random.normal(keys[2 * i], (width, 4 * width)) / np.sqrt(width),
               "w2": jax.random.normal(keys[2 * i + 1], (4 * width, width)) / np.sqrt(8 * width)}
              for i in range(layers)]
    data = {"x": jax.random.normal(jax.random.PRNGKey(1), (batch, width)),
            "y": jax.random.normal(jax.random.PRNGKey(2), (batch, width))}

    def layer(h: jax.Array, p: dict) -> jax.Array:
        return h + jnp.tanh(h @ p["w1"]) @ p["w2"]

    return _stacked_mse_step(layer), (params, data)


def plain_mlp_model(layers: int, batch: int, width: int) -> tuple[Callable, Any]:
    """(make_step(wrap), params/batch) for a plain MLP: `gelu(h W + b)` layers, no residual."""
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    params = [{"w": jax.random.normal(k, (width, width)) / np.sqrt(width), "b": jnp.zeros(width)} for k in keys]
    data = {"x": jax.random.normal(jax.random.PRNGKey(1), (batch, width)),
            "y": jax.random.normal(jax.random.PRNGKey(2), (batch, width))}

    def layer(h: jax.Array, p: dict) -> jax.Array:
        return jax.nn.gelu(h @ p["w"] + p["b"])

    return _stacked_mse_step(layer), (params, data)


def transformer_model(layers: int, batch: int, seq: int, d: int, heads: int, vocab: int) -> tuple[Callable, Any]:
    """(make_step(wrap), params/batch) for a pre-norm transformer language model."""
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 6 * layers + 2))
    norm = lambda *s: jax.random.normal(next(keys), s) / np.sqrt(s[0])  # noqa: E731
    params = {
        "embed": jax.random.normal(next(keys), (vocab, d)) * 0.02,
        "layers": [{"g1": jnp.ones(d), "qkv": norm(d, 3 * d), "o": norm(d, d), "g2": jnp.ones(d),
                    "up": norm(d, 4 * d), "down": norm(4 * d, d)} for _ in range(layers)],
        "head": norm(d, vocab),
    }
    tokens = jax.random.randint(jax.random.PRNGKey(3), (batch, seq + 1), 0, vocab)
    data = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}

    def rms(x: jax.Array, g: jax.Array) -> jax.Array:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g

    def layer(x: jax.Array, p: dict) -> jax.Array:
        b, t, _ = x.shape
        q, k, v = jnp.split(rms(x, p["g1"]) @ p["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, d // heads).transpose(0, 2, 1, 3) for a in (q, k, v))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // heads)
        mask = jnp.tril(jnp.ones((t, t), bool))
        probs = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        att = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + att @ p["o"]
        return x + jax.nn.gelu(rms(x, p["g2"]) @ p["up"]) @ p["down"]

    def make(wrap: Callable) -> Callable:
        f = wrap(layer)

        def loss(params: Any, batch: Any) -> jax.Array:
            x = params["embed"][batch["inputs"]]
            for p in params["layers"]:
                x = f(x, p)
            logits = x @ params["head"]
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1))
        return _sgd(loss)

    return make, (params, data)


VARIANTS = {
    "original": lambda f: f,
    "checkpoint every layer": jax.checkpoint,
    "checkpoint dots_saveable": lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.dots_saveable),
}


def run_model(name: str, make: Callable, args: tuple, budgets: list[float]) -> list[dict]:
    rows = []
    base = make(VARIANTS["original"])
    base_total = xla_reference(base, args).total_bytes
    base_flops = program_flops(trace(base, *args))
    for variant, wrap in VARIANTS.items():
        step = make(wrap)
        total = xla_reference(step, args).total_bytes
        flops = program_flops(trace(step, *args))
        rows.append({"model": name, "method": variant, "budget": None, "fits": None,
                     "xla_total": total, "planned_peak": None,
                     "extra_flops": (flops - base_flops) / base_flops, "seconds": None})
    for share in budgets:
        budget = int(share * base_total)
        start = time.perf_counter()
        result = fit(base, *args, budget=budget)
        seconds = time.perf_counter() - start
        rows.append({"model": name, "method": f"jaxmem.fit {int(share * 100)}%", "budget": budget,
                     "fits": result.fits, "xla_total": result.xla_total_bytes,
                     "planned_peak": result.planned_peak_bytes,
                     "extra_flops": result.recompute_flops_ratio, "seconds": seconds,
                     "min_reachable": result.min_reachable_bytes, "policy": result.policy,
                     "recomputed": len(result.recomputed)})
        print(f"  {name} {share:.0%}: fits={result.fits} xla={format_size(result.xla_total_bytes)} "
              f"plan={format_size(result.planned_peak_bytes)} +{result.recompute_flops_ratio:.1%} FLOPs "
              f"({seconds:.0f}s)", file=sys.stderr)
    for row in rows:
        row["xla_vs_original"] = row["xla_total"] / base_total
    return rows


def table(rows: list[dict]) -> str:
    out = ["| model | method | budget | fits | XLA total | vs original | jaxmem plan | extra FLOPs | fit time |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        budget = format_size(r["budget"]) if r["budget"] else ""
        fits = "" if r["fits"] is None else ("yes" if r["fits"] else f"no (min {format_size(r['min_reachable'])})")
        plan = format_size(r["planned_peak"]) if r["planned_peak"] else ""
        secs = f"{r['seconds']:.0f} s" if r["seconds"] else ""
        out.append(f"| {r['model']} | {r['method']} | {budget} | {fits} | {format_size(r['xla_total'])} | "
                   f"{r['xla_vs_original']:.0%} | {plan} | {r['extra_flops']:.1%} | {secs} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--small", action="store_true", help="4 layers, small shapes: a quick check")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    parser.add_argument("--models", default="mlp,plain,transformer",
                        help="comma-separated: mlp (residual), plain (gelu MLP), transformer")
    args = parser.parse_args(argv)
    layers = 4 if args.small else 12
    budgets = [0.70, 0.50, 0.35]
    print(f"backend: {jax.default_backend()}, jax {jax.__version__}", file=sys.stderr)
    rows = []
    models = set(args.models.split(","))
    if "mlp" in models:
        make, mlp_args = mlp_model(layers, batch=256 if args.small else 2048, width=64 if args.small else 256)
        rows += run_model(f"residual MLP {layers}L", make, mlp_args, budgets)
    if "plain" in models:
        depth = 4 if args.small else 16
        make, plain_args = plain_mlp_model(depth, batch=256 if args.small else 4096, width=64 if args.small else 512)
        rows += run_model(f"gelu MLP {depth}L", make, plain_args, budgets)
    if "transformer" in models:
        make, tf_args = transformer_model(layers, batch=2 if args.small else 8, seq=64 if args.small else 128,
                                          d=64 if args.small else 256, heads=4, vocab=256 if args.small else 1024)
        rows += run_model(f"transformer {layers}L", make, tf_args, budgets)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
