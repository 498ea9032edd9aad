"""Recompute groups merged into earlier ones that already run their nodes (residual MLP steps)."""

from __future__ import annotations

import pytest

import sys
from pathlib import Path

import jax

import jaxmem
from jaxmem.compiler.costs import jaxpr_flops
from jaxmem.fitting.fit import fit
from jaxmem.compiler.remat_graph import as_function, trace
from jaxmem.compiler.remat_search import economize, profile, search
from jaxmem.xla.cpu.compile import xla_reference

sys.path.insert(0, str(Path(__file__).parent))
from remat_helpers import assert_close  # noqa: E402
from test_remat_pin import _residual_step  # noqa: E402


def test_remat_merge_keeps_values_and_the_peak_and_saves_flops():
    step, args = _residual_step(layers=12, batch=512, width=64)
    snaps = search(trace(step, *args))
    ref = jax.jit(step)(*args)
    saved_any = False
    for snap in snaps[1:]:
        merged, saved = economize(snap.graph, snap.peak)
        if not saved:
            continue
        saved_any = True
        groups = lambda g: sum(1 for op in g.ops if op.body)  # noqa: E731
        assert groups(merged) < groups(snap.graph)
        assert profile(merged).peak <= snap.peak
        assert_close(ref, jax.jit(as_function(merged))(*args))
        # The FLOPs saved are what JAX's own jaxpr of the two rewrites says, less the few
        # scalar FLOPs of each removed group's predicate.
        before = jaxpr_flops(jax.make_jaxpr(as_function(snap.graph))(*args).jaxpr)
        after = jaxpr_flops(jax.make_jaxpr(as_function(merged))(*args).jaxpr)
        assert 0 <= before - after - saved <= 16 * (groups(snap.graph) - groups(merged))
    assert saved_any


@pytest.mark.slow  # benchmark-sized: XLA compiles of whole steps; in the slow pass
def test_remat_merge_fit_at_50_percent_under_20_percent_flops():
    step, args = _residual_step(layers=12, batch=512, width=64)
    before = xla_reference(step, args).total_bytes
    result = fit(step, *args, budget=int(0.50 * before))
    assert result.fits
    assert result.xla_total_bytes == xla_reference(result.fn, args).total_bytes <= 0.50 * before
    # Counted independently on the jaxpr JAX makes of the result. Without merging, the same
    # search needed 21.1% (two products per dropped residual value); merged, 18.3%.
    original = jaxpr_flops(jax.make_jaxpr(step)(*args).jaxpr)
    rewritten = jaxpr_flops(jax.make_jaxpr(result.fn)(*args).jaxpr)
    assert abs((rewritten - original) / original - result.recompute_flops_ratio) < 1e-6
    assert result.recompute_flops_ratio <= 0.20
    assert_close(jax.jit(step)(*args), jax.jit(result.fn)(*args))
    assert_close(jax.jit(step)(*args), jaxmem.jit(result.fn)(*args))  # and under jaxmem's executor
