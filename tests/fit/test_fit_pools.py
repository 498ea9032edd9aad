"""Issue 12, memory for free in conv nets: a differentiated max pool with non-overlapping windows
written as strided slices and a pairwise jnp.where (`fitting.pools`). Checked against JAX's own
`reduce_window` (values and gradients bit for bit, ties included), XLA's memory_analysis()
(the rewrite lowers it; pasted by hand it is the same program), and fit's and optimize's
answers."""

from __future__ import annotations

import pytest

import json

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings

from jaxmem.cli.main import main as cli_main
from jaxmem.fitting.fit import fit
from jaxmem.examples import cnn
from jaxmem.fitting.judge import Judge
from jaxmem.fitting.pools import pool_lines, pool_sites, pools_rewritten, reshape_max_pool
from jaxmem.fitting.rewrites import rewrite_first
from jaxmem.xla.cpu.compile import xla_reference

SMALL = dict(batch=4, size=16, channels=(4, 8, 16), classes=10)


def _pool(x, window, strides=None, padding="VALID"):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, window, strides or window, padding)


@settings(max_examples=15, deadline=None)
@given(st.data())
def test_reshape_max_pool_is_the_pool_and_its_gradient_bit_for_bit(data):
    rank = data.draw(st.integers(2, 4))
    shape = tuple(data.draw(st.integers(1, 7)) for _ in range(rank))
    window = tuple(data.draw(st.integers(1, n)) for n in shape)
    # Few distinct values, so most windows hold tied maxima: the gradient must go to the first,
    # as the pool's own (select_and_scatter_add, select `ge`) does.
    levels = data.draw(st.integers(1, 4))
    x = jnp.asarray(np.random.default_rng(data.draw(st.integers(0, 2**16))).integers(0, levels, shape), jnp.float32)
    g = jnp.asarray(np.random.default_rng(1).standard_normal(_pool(x, window).shape), jnp.float32)
    # each side compiled whole, as the rewrite runs under jax.jit (op by op, every primitive of
    # every new shape compiles on its own: several times slower)
    pool_and_grad = lambda f: jax.jit(lambda v, g: (f(v), jax.vjp(f, v)[1](g)[0]))
    want, want_grad = pool_and_grad(lambda v: _pool(v, window))(x, g)
    got, got_grad = pool_and_grad(lambda v: reshape_max_pool(v, window))(x, g)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_grad, want_grad)


def _pooled_step(pool=None):
    """A small conv net's SGD step: a pool under the gradient on one line, an overlapping pool
    (3x3 stride 2) on another, and a pool only run forward (a metric) on a third."""
    rng = np.random.default_rng(0)
    w1 = jnp.asarray(rng.standard_normal((3, 3, 3, 8)) / 5, jnp.float32)
    w2 = jnp.asarray(rng.standard_normal((3, 3, 8, 8)) / 8, jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 16, 16, 3)), jnp.float32)

    def loss(ws, x):
        h = jax.nn.relu(jax.lax.conv_general_dilated(x, ws[0], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
        h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID") if pool is None else pool(h, (1, 2, 2, 1))
        h = jax.nn.relu(jax.lax.conv_general_dilated(h, ws[1], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
        h = _pool(h, (1, 3, 3, 1), (1, 2, 2, 1))
        return jnp.mean(h ** 2)

    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        metric = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID").sum()
        return [w - 0.1 * g for w, g in zip(ws, grads)], value, metric

    return step, ([w1, w2], x)


def test_sites_are_the_differentiated_pools_with_non_overlapping_windows():
    step, args = _pooled_step()
    (site,) = pool_sites(step, args)
    assert site.call.file == __file__ and site.windows == ((1, 2, 2, 1),) and site.pools == 1
    assert site.call.text.startswith("h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1)")
    assert pool_sites(lambda x: _pool(x, (1, 2, 2, 1)).sum(), (args[1],)) == []  # forward only
    lines = pool_lines([site])
    assert lines[0].startswith(f"{__file__}:") and "reshape_max_pool(x, (1, 2, 2, 1))" in lines[0]
    assert lines[2].startswith("def reshape_max_pool(")


def test_the_rewrite_is_the_step_written_by_hand_and_xla_holds_less():
    step, args = _pooled_step()
    rewritten = pools_rewritten(step, pool_sites(step, args))
    by_hand, _ = _pooled_step(pool=reshape_max_pool)
    text = str(jax.make_jaxpr(rewritten)(*args))
    assert text == str(jax.make_jaxpr(by_hand)(*args))
    # Only the site's pool changed: the overlapping pool and the forward-only one are JAX's own.
    assert text.count("select_and_scatter_add") == 1 and text.count("reduce_window_max") == 2
    # Outside the rewritten function the hook is JAX's own.
    assert "select_and_scatter_add" in str(jax.make_jaxpr(step)(*args)).split("reduce_window_max", 1)[1]
    for a, b in zip(jax.tree.leaves(jax.jit(step)(*args)), jax.tree.leaves(jax.jit(rewritten)(*args))):
        np.testing.assert_array_equal(a, b)


def test_xla_cpu_total_drops_on_the_suite_cnn_and_values_stay():
    step, args = cnn.make_train_step(**SMALL)
    before = xla_reference(step, args, donate_argnums=(0, 1)).total_bytes
    (found,) = rewrite_first(step, args, (0, 1), Judge(None), before)
    assert found.kind == "max pools" and found.values_equal is True
    assert found.xla_total_bytes == xla_reference(found.fn, args, donate_argnums=(0, 1)).total_bytes < before
    assert 0 < found.extra_flops < 0.05 * found.flops  # the compares and selects of the masks
    # Nothing to gain: no rewrite kept where the total does not drop.
    assert rewrite_first(step, args, (0, 1), Judge(None), found.xla_total_bytes) == []


@pytest.mark.slow  # tens of seconds of XLA compiles; in the slow pass
def test_fit_starts_from_the_rewritten_pools_and_prints_them_first(capsys):
    step, args = cnn.make_train_step(**SMALL)
    result = fit(step, *args, budget="100GiB", donate_argnums=(0, 1), rewrite=False)
    (pools,) = result.rewrites
    assert result.xla_total_bytes == pools.xla_total_bytes < result.xla_total_bytes_before
    assert result.original_fn is step and result.policies.candidates[0].xla_total_bytes == pools.xla_total_bytes
    assert result.policies.base_label == "max pools rewritten"
    unchanged = fit(step, *args, budget="100GiB", donate_argnums=(0, 1), rewrite=False, source_rewrites=False)
    assert unchanged.rewrites == [] and unchanged.xla_total_bytes == unchanged.xla_total_bytes_before
    assert cli_main(["optimize", "jaxmem.examples.suite:cnn_train", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    (pools,) = data["rewrites"]
    assert pools["values_equal"] is True and data["values_unchanged"] is True
    assert pools["xla_total_bytes"] < data["xla_total_bytes_before"]
    assert any("def reshape_max_pool(" in line for line in pools["code"])


def test_the_printed_function_runs_where_it_is_pasted():
    scope = {"jax": jax, "jnp": jnp}
    exec("\n".join(pool_lines([])[1:]), scope)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 6, 6, 3)), jnp.float32)
    np.testing.assert_array_equal(scope["reshape_max_pool"](x, (1, 2, 2, 1)), _pool(x, (1, 2, 2, 1)))
