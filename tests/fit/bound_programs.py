"""Small training steps for the lower-bound tests (imported by the XLA:GPU child script)."""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.examples.adam import adam_state_midrun, adam_update


def _normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale)


def _step(loss_fn: Callable[..., Any]) -> Callable[..., Any]:
    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        new_params, new_state = adam_update(params, grads, opt_state)
        return loss, new_params, new_state
    return step


def embedding_lm(vocab: int = 4096, d: int = 256, batch: int = 32, seq: int = 64) -> tuple[Any, tuple[Any, ...]]:
    """Token embedding (a gather: its gradient a scatter-add), two dense layers, tied logits."""
    rng = np.random.default_rng(3)
    params = {"embed": _normal(rng, (vocab, d), 0.02), "w1": _normal(rng, (d, 2 * d), d ** -0.5),
              "w2": _normal(rng, (2 * d, d), (2 * d) ** -0.5)}
    tokens = jnp.asarray(rng.integers(0, vocab, (batch, seq + 1)), jnp.int32)

    def loss_fn(p: Any, tok: jax.Array) -> jax.Array:
        x = p["embed"][tok[:, :-1]]
        for _ in range(2):  # two layers sharing weights, a loop site
            x = x + jnp.tanh(x @ p["w1"]) @ p["w2"]
        logits = x @ p["embed"].T
        logp = jax.nn.log_softmax(logits[:, :, :512])   # a slice of the vocabulary keeps it small
        return -jnp.mean(jnp.take_along_axis(logp, tok[:, 1:, None] % 512, axis=-1))

    return _step(loss_fn), (params, adam_state_midrun(params), tokens)


def deep_mlp(width: int = 512, layers: int = 4, batch: int = 1024) -> tuple[Any, tuple[Any, ...]]:
    """GEMMs only: a Python loop of tanh layers."""
    rng = np.random.default_rng(4)
    params = [_normal(rng, (width, width), width ** -0.5) for _ in range(layers)]
    x = _normal(rng, (batch, width), 1.0)

    def loss_fn(p: Any, x: jax.Array) -> jax.Array:
        for w in p:
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    return _step(loss_fn), (params, adam_state_midrun(params), x)


def attention_lm(layers: int = 2, seq: int = 512) -> tuple[Any, tuple[Any, ...]]:
    """A small transformer (d 64, 2 heads, `dot_product_attention`) whose [1, 2, seq, seq]
    attention scores are its largest values: the backward's softmax reads two of them at once."""
    from jaxmem.examples import zoo

    return zoo._lm(layers, 64, 2, seq=seq, batch=1, vocab=512)


def recorded_xla_gpu_rows() -> Iterator[dict[str, Any]]:
    """Every XLA:GPU row of fit's bench in `benchmarks/results/*.jsonl`, file by file: what the
    bounds are checked against besides the compiles of each test. Where fit rewrote the source
    first (max pools, attention in blocks), its policy and rewrite totals are of another program,
    which the bound (over the policies and orders of the step as written) does not cover: they
    are left out, and the original and the comparison columns (the step as written) kept."""
    here = os.path.dirname(__file__)
    for path in sorted(glob.glob(os.path.join(here, "..", "..", "benchmarks", "results", "*.jsonl"))):
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if not row.get("judge", "").startswith("XLA:GPU") or "original" not in row:
                    continue
                if row.get("rewrites"):
                    row = {**row, "policy_total": None, "rewrite_total": None}
                yield row


def scanned_lm(policy: str | None = "default", layers: int = 4, seq: int = 512) -> tuple[Any, tuple[Any, ...]]:
    """The small transformer with its layers stacked and run under `lax.scan`, the body under
    `jax.checkpoint` with `policy` (a name in `jax.checkpoint_policies`, "default" for none
    given, "offload_carry" for the layer's input offloaded to pinned host memory as MaxText
    does, "offload_dots_with_no_batch_dims" and "offload_every_dot" for GEMM results offloaded,
    None for no checkpoint): the variants of one scanned step a policy can make."""
    from jaxmem.examples import zoo
    from jax.ad_checkpoint import checkpoint_name

    from jaxmem.examples.layers import layernorm

    _, args = zoo._lm(layers, 64, 2, seq=seq, batch=1, vocab=512, scan=True)   # its parameters

    def layer(x: jax.Array, p: Any) -> jax.Array:
        return zoo._block(p, x, 2, jnp.float32)

    if policy == "default":
        body = jax.checkpoint(layer)
    elif policy == "offload_carry":
        offload = jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=["scan_carry"],
            offload_src="device", offload_dst="pinned_host")
        body = jax.checkpoint(lambda x, p: layer(checkpoint_name(x, "scan_carry"), p),
                              policy=offload)
    elif policy == "offload_dots_with_no_batch_dims":
        body = jax.checkpoint(layer, policy=jax.checkpoint_policies.offload_dot_with_no_batch_dims(
            "device", "pinned_host"))
    elif policy == "offload_every_dot":
        # Every GEMM's result to pinned host memory, the attention scores' batched ones included.
        from jax._src.interpreters.partial_eval import Offloadable

        def every_dot(prim: Any, *_: Any, **__: Any) -> Any:
            return Offloadable(src="device", dst="pinned_host") if prim is jax.lax.dot_general_p else False

        body = jax.checkpoint(layer, policy=every_dot)
    elif policy is not None:
        body = jax.checkpoint(layer, policy=getattr(jax.checkpoint_policies, policy))
    else:
        body = layer

    def loss_fn(p: Any, tokens: jax.Array) -> jax.Array:
        x = p["embed"][tokens[:, :-1]]
        x, _ = jax.lax.scan(lambda c, lp: (body(c, lp), None), x, p["layers"])
        x = layernorm(x, p["ln_f"], p["ln_f_b"])
        logp = jax.nn.log_softmax(x @ p["embed"].T, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return _step(loss_fn), args


def scanned_bounds_script(policies: list) -> str:
    """The XLA:GPU child script of the scanned-step bound tests (`run_gpu_script` fills `{tests}`):
    the 4-layer scanned step as written, its H100 floor and half-temp budget, both bounds (without
    and with offload policies), fit's verdict, and XLA:GPU's total under each body policy."""
    return SCANNED_BOUNDS_CHILD.replace("{policies!r}", repr(policies))


SCANNED_BOUNDS_CHILD = r"""
import json, sys
sys.path.insert(0, "{tests}")
from bound_programs import scanned_lm
from jaxmem.fitting.bound import lower_bound, verdict
from jaxmem.fitting.judge import Judge

judge = Judge("h100-80gb")
fn, args = scanned_lm("default")
figures = judge.figures(fn, args, (0, 1))
bound = lower_bound(fn, args, (0, 1), figures.floor)
offload = lower_bound(fn, args, (0, 1), figures.floor, host_offload=True)
totals = {{}}
for policy in {policies!r}:
    f, a = scanned_lm(policy)
    totals[str(policy)] = judge.total(f, a, (0, 1))
    print(policy, totals[str(policy)], file=sys.stderr, flush=True)
out = {{"floor": figures.floor, "half_temp": figures.half_temp, "bound": bound.bytes, "line": bound.describe(),
        "residual": bound.residual_bytes, "state": bound.loop_state_bytes,
        "offload": offload.bytes, "offload_line": offload.describe(), "offload_residual": offload.residual_bytes,
        "totals": totals, "verdict": verdict(fn, args, (0, 1), figures.half_temp, figures.floor, judge.name)}}
print(json.dumps(out))
"""
