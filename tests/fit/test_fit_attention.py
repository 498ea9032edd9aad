"""Issue 12, long attention in blocks of queries (`fitting.attention`): each block under
jax.checkpoint, a causal block reading only the keys up to its last query. Checked against
`jax.nn.dot_product_attention` itself (values and gradients), the step written by hand with the
printed function (the same program), and XLA's memory_analysis() (the total drops)."""

from __future__ import annotations

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.examples import zoo
from jaxmem.fitting.attention import (attention_chunked, attention_lines, attention_sites, chunk_sizes,
                                      chunked_dot_product_attention)
from jaxmem.fitting.judge import Judge
from jaxmem.fitting.rewrites import rewrite_first
from jaxmem.xla.cpu.compile import xla_reference


def _qkv(t, s, heads, kv_heads, dim=16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((2, t, heads, dim)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, s, kv_heads, dim)), jnp.float32) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("t,s,heads,kv_heads,causal,chunk", [
    (96, 96, 4, 4, True, 32), (96, 96, 4, 2, True, 40), (64, 96, 2, 2, True, 16), (96, 64, 2, 1, False, 32),
    (50, 50, 2, 2, False, 64)])
def test_blocks_give_dot_product_attention_and_its_gradients(t, s, heads, kv_heads, causal, chunk):
    q, k, v = _qkv(t, s, heads, kv_heads)
    g = jnp.asarray(np.random.default_rng(1).standard_normal(q.shape), jnp.float32)

    def whole(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    def blocks(q, k, v):
        return chunked_dot_product_attention(q, k, v, is_causal=causal, chunk=chunk, implementation="xla")

    # each side compiled whole, as the rewrite runs under jax.jit (op by op is several times slower)
    value_and_vjp = lambda f: jax.jit(lambda q, k, v, g: (f(q, k, v), jax.vjp(f, q, k, v)[1](g)))
    want, want_grads = value_and_vjp(whole)(q, k, v, g)
    got, got_grads = value_and_vjp(blocks)(q, k, v, g)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _lm(attention=None):
    if attention is None:
        return zoo._lm(2, 64, 2, seq=1024, batch=1, vocab=256)
    real = jax.nn.dot_product_attention
    jax.nn.dot_product_attention = attention   # what the user writes on zoo.py's attention line
    try:
        step, args = zoo._lm(2, 64, 2, seq=1024, batch=1, vocab=256)
        return jax.make_jaxpr(step)(*args), args
    finally:
        jax.nn.dot_product_attention = real


def test_sites_are_the_long_plain_calls_by_line():
    step, args = _lm()
    (site,) = attention_sites(step, args)
    assert site.call.file == zoo.__file__ and site.calls == 2 and site.causal
    assert (site.queries, site.keys, site.heads) == (1024, 1024, 2)
    assert "jax.nn.dot_product_attention(q, k, v, is_causal=True" in site.call.text
    assert chunk_sizes([site]) == [256, 128]
    lines = attention_lines([site], 256)
    assert "chunk=256" in lines[0] and lines[2].startswith("def chunked_dot_product_attention(")
    short, short_args = zoo._lm(1, 64, 2, seq=256, batch=1, vocab=256)
    assert attention_sites(short, short_args) == []      # under 512 queries: left as written
    q, k, v = _qkv(1024, 1024, 2, 2)
    masked = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=jnp.ones((1, 1, 1024, 1024), bool)).sum()
    assert attention_sites(masked, (q, k, v)) == []      # its own mask: not rewritten


@pytest.mark.slow  # benchmark-sized: XLA compiles of whole steps; in the slow pass
def test_the_rewrite_is_the_step_written_by_hand_and_xla_cpu_holds_less():
    step, args = _lm()
    (site,) = attention_sites(step, args)
    chunked = attention_chunked(step, [site], 256)

    real = jax.nn.dot_product_attention

    def by_hand(q, k, v, is_causal=False, implementation=None):
        jax.nn.dot_product_attention = real        # the blocks call JAX's own
        try:
            return chunked_dot_product_attention(q, k, v, is_causal=is_causal, chunk=256,
                                                 implementation=implementation)
        finally:
            jax.nn.dot_product_attention = by_hand

    hand, _ = _lm(by_hand)
    assert str(jax.make_jaxpr(chunked)(*args)) == str(hand)
    before = xla_reference(step, args, donate_argnums=(0, 1)).total_bytes
    (kept,) = rewrite_first(step, args, (0, 1), Judge(None), before)
    assert kept.kind == "attention in blocks" and kept.values_equal is True and kept.extra_flops < 0
    assert kept.xla_total_bytes == xla_reference(kept.fn, args, donate_argnums=(0, 1)).total_bytes < before


def test_the_printed_function_runs_where_it_is_pasted():
    # Only jax and jnp, which a model file has: nothing of jaxmem's or typing's.
    source = "\n".join(attention_lines([], 256)[1:])
    scope = {"jax": jax, "jnp": jnp}
    exec(source, scope)
    q, k, v = _qkv(96, 96, 2, 2)
    np.testing.assert_allclose(scope["chunked_dot_product_attention"](q, k, v, is_causal=True, chunk=32),
                               jax.nn.dot_product_attention(q, k, v, is_causal=True), rtol=1e-5, atol=1e-6)


GPU_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import jax
    from test_fit_attention import _lm
    from jaxmem.fitting.fit import fit
    from jaxmem.fitting.attention import chunked_dot_product_attention
    from jaxmem.xla.gpu.compile import compile_for_gpu
    step, args = _lm()
    r = fit(step, *args, budget="half-temp", donate_argnums=(0, 1), device="h100-80gb", rewrite=False)
    (kept,) = r.rewrites
    chunk = int(kept.lines[0].split("chunk=")[1].split(")")[0])
    real = jax.nn.dot_product_attention

    def by_hand(q, k, v, is_causal=False, implementation=None):   # the printed line, pasted
        jax.nn.dot_product_attention = real
        try:
            return chunked_dot_product_attention(q, k, v, is_causal=is_causal, chunk=chunk,
                                                 implementation=implementation)
        finally:
            jax.nn.dot_product_attention = by_hand

    jax.nn.dot_product_attention = by_hand
    try:
        # a new function: JAX's cache holds the step's traces from fit, made without the paste
        d = compile_for_gpu(lambda *a: step(*a), args, spec="h100_sxm", device="h100-80gb",
                            donate_argnums=(0, 1), use_cache=False)
    finally:
        jax.nn.dot_product_attention = real
    print(json.dumps({{"before": r.xla_total_bytes_before, "kept": kept.xla_total_bytes, "fits": r.policy_fits,
                      "by_hand": d["argument_bytes"] + d["output_bytes"] + d["temp_bytes"] - d["alias_bytes"],
                      "flops": kept.extra_flops, "equal": kept.values_equal, "budget": r.budget_bytes}}))
""")


@pytest.mark.slow
def test_xla_gpu_total_drops_and_the_step_written_by_hand_compiles_to_it(run_gpu_script):
    data = run_gpu_script(GPU_SCRIPT)
    assert data["by_hand"] == data["kept"] < data["before"] and data["equal"] and data["flops"] < 0
    assert data["fits"] and data["kept"] <= data["budget"]
