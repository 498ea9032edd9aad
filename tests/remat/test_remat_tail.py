"""A recompute group's elementwise tail runs after the group, where XLA fuses it (gelu MLP steps)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxmem
from jaxmem.fitting.fit import fit
from jaxmem.compiler.remat_graph import trace
from jaxmem.compiler.remat_search import _tail, candidates, profile
from jaxmem.xla.cpu.compile import xla_reference
from remat_helpers import assert_close, sgd_step


def _gelu_step(layers: int = 8, batch: int = 1024, width: int = 128):
    keys = jax.random.split(jax.random.PRNGKey(0), layers)
    params = [{"w": jax.random.normal(k, (width, width)) / np.sqrt(width), "b": jnp.zeros(width)}
              for k in keys]
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))

    def loss(params, x):
        for p in params:
            x = jax.nn.gelu(x @ p["w"] + p["b"])
        return jnp.mean(x * x)

    return sgd_step(loss), (params, x)



def test_remat_tail_is_elementwise_and_fed_by_the_group():
    step, args = _gelu_step(layers=3, batch=64, width=32)
    graph = trace(step, *args)
    lv = profile(graph)
    seen = 0
    for group in candidates(graph, lv):
        tail = _tail(graph, group.chain)
        made = {o for p in group.chain for o in graph.ops[p].outputs if o is not None}
        body = [p for p in group.chain if p not in tail]
        assert body, "the group keeps at least one node"
        for p in tail:
            node = graph.ops[p]
            assert node.primitive not in ("dot_general", "reduce_sum", "transpose")
            assert any(w in made for w in node.inputs)  # reads a fresh copy, so no CSE
        for p in body:  # the group never reads what runs after it
            assert not any(w in {o for q in tail for o in graph.ops[q].outputs} for w in graph.ops[p].inputs)
        seen += bool(tail)
    assert seen > 0


def test_remat_tail_fit_meets_35_percent_by_xla():
    step, args = _gelu_step()
    before = xla_reference(step, args).total_bytes
    result = fit(step, *args, budget=int(0.35 * before))
    # XLA is the judge. With the gelu recomputed inside the group (its product and every
    # elementwise intermediate materialized at the conditional's boundary) the deepest rewrite
    # reached 48.2% of the original's total (measured before the change); with the tail after
    # the group it reaches 33.4%.
    assert result.fits
    assert result.xla_total_bytes == xla_reference(result.fn, args).total_bytes <= 0.35 * before
    assert_close(jax.jit(step)(*args), jax.jit(result.fn)(*args))
    assert_close(jax.jit(step)(*args), jaxmem.jit(result.fn)(*args))  # and under jaxmem's executor


def test_remat_tail_fit_at_50_percent_recomputes_little():
    step, args = _gelu_step()
    before = xla_reference(step, args).total_bytes
    result = fit(step, *args, budget=int(0.50 * before))
    # Measured before the change: 50% took 35.1% extra FLOPs (whole layers recomputed); with
    # the tail outside the group, elementwise recompute alone gets there (1.0%).
    assert result.fits and result.recompute_flops_ratio <= 0.05
    assert_close(jax.jit(step)(*args), jax.jit(result.fn)(*args))
