"""A gradient product after a recompute group is pinned behind it (residual MLP steps)."""

from __future__ import annotations

import pytest

import jax
import numpy as np

import jaxmem
from jaxmem.fitting.fit import fit
from jaxmem.compiler.remat_graph import as_function, trace
from jaxmem.compiler.remat_search import search
from jaxmem.xla.cpu.compile import xla_reference
from remat_helpers import assert_close, sgd_step


def _residual_step(layers: int = 8, batch: int = 1024, width: int = 128):
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * layers)
    params = [{"w1": jax.random.normal(keys[2 * i], (width, 4 * width)) / np.sqrt(width),
               "w2": jax.random.normal(keys[2 * i + 1], (4 * width, width)) / np.sqrt(8 * width)}
              for i in range(layers)]
    x = jax.random.normal(jax.random.PRNGKey(1), (batch, width))
    y = jax.random.normal(jax.random.PRNGKey(2), (batch, width))

    def loss(params, x, y):
        h = x
        for p in params:
            h = h + jax.numpy.tanh(h @ p["w1"]) @ p["w2"]
        return jax.numpy.mean((h - y) ** 2)

    return sgd_step(loss, lr=1e-3), (params, x, y)



def test_remat_pin_groups_hand_back_an_operand_and_keep_values():
    step, args = _residual_step(layers=3, batch=64, width=32)
    snaps = search(trace(step, *args))
    pinned = [g for g in snaps[-1].groups if g.through is not None]
    assert pinned
    node_through = [n.through for n in snaps[-1].graph.ops if n.body and n.through]
    assert node_through and all(len(t) == 1 for t in node_through)
    ref = jax.jit(step)(*args)
    for snap in snaps[1:]:
        assert_close(ref, jax.jit(as_function(snap.graph))(*args))


@pytest.mark.slow  # benchmark-sized: XLA compiles of whole steps; in the slow pass
def test_remat_pin_fit_meets_50_percent_by_xla():
    step, args = _residual_step()
    before = xla_reference(step, args).total_bytes
    result = fit(step, *args, budget=int(0.50 * before))
    # XLA is the judge. Unpinned, XLA:CPU ran each layer's `g W2^T` (4 MiB here) before the
    # group recomputing that layer's tanh, beside the group's product and tanh; the deepest
    # rewrite then reached 52.4% of the original's total (measured before the change).
    assert result.fits
    assert result.xla_total_bytes == xla_reference(result.fn, args).total_bytes <= 0.50 * before
    assert_close(jax.jit(step)(*args), jax.jit(result.fn)(*args))
    assert_close(jax.jit(step)(*args), jaxmem.jit(result.fn)(*args))  # and under jaxmem's executor
