"""The executor's fast paths against XLA: pooling gradients with ties and NaNs, the bitwise
select, window reductions as strided passes, and intermediates computed in the next slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxmem
from jaxmem.execution.primitives import jax_kernel, kernel_for

RNG = np.random.default_rng(7)


def _find(jaxpr, name):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            return eqn
        for v in eqn.params.values():
            inner = getattr(v, "jaxpr", None)
            if inner is not None:
                found = _find(getattr(inner, "jaxpr", inner), name)
                if found is not None:
                    return found
    return None


@pytest.mark.parametrize("shape,window,strides,padding,ties,nan,inf_source", [
    ((2, 8, 8, 3), (1, 2, 2, 1), (1, 2, 2, 1), "VALID", True, False, False),
    ((2, 9, 9, 3), (1, 3, 3, 1), (1, 2, 2, 1), "SAME", True, False, False),
    ((2, 9, 9, 3), (1, 3, 3, 1), (1, 1, 1, 1), "SAME", False, False, False),
    ((2, 8, 8, 3), (1, 2, 2, 1), (1, 2, 2, 1), "VALID", True, True, False),
    ((2, 8, 8, 3), (1, 2, 2, 1), (1, 2, 2, 1), "VALID", False, False, True),
    ((2, 7, 7, 3), (1, 3, 3, 1), (1, 2, 2, 1), "VALID", False, True, False),
])
def test_max_pool_gradient_matches_xla(shape, window, strides, padding, ties, nan, inf_source):
    x = (RNG.integers(0, 4, shape) if ties else RNG.standard_normal(shape)).astype(np.float32)
    if nan:
        x.flat[RNG.integers(0, x.size, 5)] = np.nan
    pool = lambda v: jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, window, strides, padding)
    y, vjp = jax.vjp(pool, x)
    g = RNG.standard_normal(y.shape).astype(np.float32)
    if inf_source:
        g.flat[0] = np.inf
    eqn = _find(jax.make_jaxpr(lambda a, b: vjp(b))(x, g).jaxpr, "select_and_scatter_add")
    kernel = kernel_for(eqn)
    assert kernel.name == "numpy"
    want = np.asarray(jax_kernel(eqn).compute(g, x))
    # overlapping windows add in another order than XLA's: equal to rounding, NaN for NaN
    scale = 1e-5 * max(1.0, float(np.nanmax(np.abs(np.where(np.isinf(want), 0, want)))))
    np.testing.assert_allclose(kernel.compute(g, x), want, rtol=0, atol=scale)
    if kernel.into is not None:
        out = np.full(want.shape, np.nan, np.float32)
        kernel.into(out, g, x)
        np.testing.assert_allclose(out, want, rtol=0, atol=scale)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.uint16, np.int32, np.bool_])
def test_select_is_bit_exact_in_place(dtype):
    shape = (5, 7)
    eqn = jax.make_jaxpr(lambda p, f, t: jax.lax.select(p, t, f))(
        np.zeros(shape, bool), np.zeros(shape, dtype), np.zeros(shape, dtype)).jaxpr.eqns[0]
    kernel = kernel_for(eqn)
    p = RNG.random(shape) > 0.5
    f = (RNG.standard_normal(shape) * 5).astype(dtype)
    t = (RNG.standard_normal(shape) * 5).astype(dtype)
    if dtype == np.float32:
        f[0, 0], t[1, 1] = np.nan, -0.0
    want = np.asarray(jax.lax.select(p, t, f))
    assert kernel.compute(p, f, t).tobytes() == want.tobytes()
    for alias in ("f", "t"):  # the output is one of the cases' own memory
        ff, tt = f.copy(), t.copy()
        out = ff if alias == "f" else tt
        kernel.into(out, p, ff, tt)
        assert out.tobytes() == want.tobytes()


def test_fused_intermediates_go_into_the_next_slot_and_stay_right():
    def f(x, w, b):
        h = jax.nn.relu(x @ w + b)
        return (h * 2.0 + 1.0).sum(), jnp.tanh(h * 0.5 - 1.0)

    x = RNG.standard_normal((64, 32)).astype(np.float32)
    w = RNG.standard_normal((32, 48)).astype(np.float32)
    b = RNG.standard_normal((48,)).astype(np.float32)
    planned = jaxmem.jit(f)
    executable = planned.lower(x, w, b)
    assert executable.program.chained >= 1, executable.program.source
    executable.arena[...] = 0xFF  # NaN everywhere: nothing may read a slot before it is written
    got = planned(x, w, b)
    want = jax.jit(f)(x, w, b)
    for g_, w_ in zip(got, want):
        w_ = np.asarray(w_)
        assert np.max(np.abs(g_ - w_)) <= 1e-5 * max(1.0, float(np.max(np.abs(w_))))
