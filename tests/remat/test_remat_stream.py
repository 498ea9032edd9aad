"""A residual stream read by elementwise norms is held in memory, as XLA holds it (pre-norm steps)."""

from __future__ import annotations

import pytest

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem.compiler.remat_search as remat_search
from jaxmem.fitting.fit import fit
from jaxmem.compiler.remat_graph import trace
from jaxmem.xla.cpu.compile import xla_reference
from remat_helpers import assert_close, sgd_step


def _prenorm_step(layers: int = 12, batch: int = 512, width: int = 64):
    """An SGD step of `x + gelu(rms(x) W1) W2` layers: every sum of the stream feeds the next
    sum and an RMS norm (elementwise and a reduction), in the forward and in the backward."""
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * layers)
    params = [{"g": jnp.ones(width),
               "up": jax.random.normal(keys[2 * i], (width, 4 * width)) / np.sqrt(width),
               "down": jax.random.normal(keys[2 * i + 1], (4 * width, width)) / np.sqrt(4 * width)}
              for i in range(layers)]
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))

    def loss(params, x):
        for p in params:
            n = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * p["g"]
            x = x + jax.nn.gelu(n @ p["up"]) @ p["down"]
        return jnp.mean(x * x)

    return sgd_step(loss), (params, x)



def test_remat_stream_sums_are_held_not_fused():
    step, args = _prenorm_step()
    graph = trace(step, *args)
    lv = remat_search.profile(graph)
    stream = [v for op in graph.ops if op.primitive == "add"
              for v in op.outputs if v is not None and graph.program.shapes[v] == args[1].shape]
    assert len(stream) == 12
    # Fusing every sum into its readers would re-emit the first sums in the readers of every
    # later one. The model holds every other sum (a held sum's operand is fused again), as
    # XLA:CPU's buffer assignment of the 12-layer transformer holds one sum per layer.
    assert sum(v in lv.virtual for v in stream) <= len(stream) // 2 + 1
    remat_search.MAX_FUSED_READERS, old = 10**9, remat_search.MAX_FUSED_READERS
    try:
        unbounded = remat_search.profile(graph)
    finally:
        remat_search.MAX_FUSED_READERS = old
    assert all(v in unbounded.virtual for v in stream)


@pytest.mark.slow  # benchmark-sized: XLA compiles of whole steps; in the slow pass
def test_remat_stream_fit_meets_30_percent_by_xla():
    step, args = _prenorm_step()
    before = xla_reference(step, args).total_bytes
    budget = int(0.30 * before)
    result = fit(step, *args, budget=budget)
    # XLA is the judge. With every stream sum modelled as fused, the deepest rewrite reached
    # 31.0% of the original's total (8,532,124 of 27,533,612 bytes: measured before the
    # change), so 30% did not fit; holding the sums, the search reaches 28.6%.
    assert result.fits
    assert result.xla_total_bytes == xla_reference(result.fn, args).total_bytes <= budget
    assert result.recompute_flops_ratio > 0
    assert_close(jax.jit(step)(*args), jax.jit(result.fn)(*args))
