"""Each numpy rule against JAX itself, on ordinary and hostile values (NaN, inf, -0.0, extremes)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from execution_oracle import check_equations
from jaxmem.execution.primitives import KERNELS, jax_kernel, kernel_for

RNG = np.random.default_rng(0)
F = RNG.standard_normal((4, 6)).astype(np.float32) * 3
G = RNG.standard_normal((4, 6)).astype(np.float32)
# no subnormals: XLA on CPU flushes them to zero, numpy keeps them
SPECIAL = np.array([0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 1.5, -2.5, np.nan, np.inf, -np.inf, 3e38, -3e38, 1e-30,
                    2.5, 7.0, 2147483520.0, -2147483648.0, 4e9, 1e20], np.float32)
INTS = np.array([0, 1, -1, 7, -7, 2**31 - 1, -2**31, 3, -3, 100, -100, 5], np.int32)
DIVS = np.array([0, 2, -2, 0, 3, -1, -1, 1, -3, 7, 0, -5], np.int32)


def _run(fn, *args, rtol=1e-5):
    counts = check_equations(fn, *args, rtol=rtol)
    assert any(not k.startswith("jax:") for k in counts), f"no numpy rule was exercised: {counts}"
    return counts


@pytest.mark.parametrize("op", [
    jnp.add, jnp.subtract, jnp.multiply, jnp.divide, jnp.maximum, jnp.minimum, jnp.power,
    lambda a, b: jax.lax.rem(a, b), lambda a, b: jnp.arctan2(a, b), lambda a, b: jnp.nextafter(a, b),
    lambda a, b: a == b, lambda a, b: a != b, lambda a, b: a < b, lambda a, b: a <= b, lambda a, b: a > b,
    lambda a, b: a >= b, lambda a, b: jnp.where(a > b, a, b), lambda a, b: jax.lax.clamp(-1.0, a, 1.0),
])
def test_binary_float_rules_match_jax(op):
    a = np.concatenate([F.ravel(), SPECIAL])
    b = np.concatenate([G.ravel(), SPECIAL[::-1]])
    _run(op, a, b)


@pytest.mark.parametrize("op", [
    jnp.exp, jnp.exp2, jnp.log, jnp.log1p, jnp.expm1, jnp.tanh, jnp.sin, jnp.cos, jnp.tan, jnp.arcsin,
    jnp.arccos, jnp.arctan, jnp.sinh, jnp.cosh, jnp.arcsinh, jnp.arctanh, jnp.sqrt, jnp.cbrt,
    jax.lax.rsqrt, jnp.abs, jnp.sign, jnp.floor, jnp.ceil, jnp.round, jnp.negative, jnp.isfinite,
    jnp.square, jax.nn.sigmoid, jax.scipy.special.erf, jax.scipy.special.erfc, jax.scipy.special.erfinv,
    lambda x: x ** 3, lambda x: x ** -2, lambda x: x ** 7,
    lambda x: jax.lax.round(x, jax.lax.RoundingMethod.AWAY_FROM_ZERO),
    lambda x: jax.lax.round(x, jax.lax.RoundingMethod.TO_NEAREST_EVEN),
    lambda x: jax.nn.gelu(x, approximate=False), jax.nn.gelu, jax.nn.silu, jax.nn.relu,
])
def test_unary_float_rules_match_jax(op):
    # libm and XLA's own approximations of transcendental functions differ by a few ulps
    _run(op, np.concatenate([F.ravel(), SPECIAL]), rtol=2e-5)


@pytest.mark.parametrize("op", [
    lambda a, b: jax.lax.div(a, b), lambda a, b: jax.lax.rem(a, b), jnp.add, jnp.subtract, jnp.multiply,
    jnp.maximum, jnp.minimum, lambda a, b: a & b, lambda a, b: a | b, lambda a, b: a ^ b, lambda a, b: ~a,
    lambda a, b: jax.lax.shift_left(a, b), lambda a, b: jax.lax.shift_right_logical(a, b),
    lambda a, b: jax.lax.shift_right_arithmetic(a, b), lambda a, b: a < b, lambda a, b: jnp.abs(a),
    lambda a, b: a ** 3, lambda a, b: jnp.sign(a), lambda a, b: a.astype(jnp.float32),
    lambda a, b: a.astype(jnp.int8), lambda a, b: a.astype(jnp.uint32), lambda a, b: a.astype(bool),
])
def test_integer_rules_are_exact(op):
    _run(op, INTS, DIVS)


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.int32, 16, elements=st.integers(-2**31, 2**31 - 1)),
       hnp.arrays(np.int32, 16, elements=st.integers(-40, 40) | st.sampled_from([0, -1, 2**31 - 1, -2**31])))
def test_integer_division_and_shifts_match_xla_on_any_values(a, b):
    check_equations(lambda x, y: (jax.lax.div(x, y), jax.lax.rem(x, y), jax.lax.shift_left(x, y),
                                  jax.lax.shift_right_arithmetic(x, y), jax.lax.shift_right_logical(x, y)), a, b)


@settings(max_examples=60, deadline=None)
# no subnormals: XLA on the CPU flushes them to zero, numpy keeps them
@given(hnp.arrays(np.float32, 16, elements=st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=False)))
def test_float_to_int_conversion_saturates_like_xla(x):
    check_equations(lambda v: (v.astype(jnp.int32), v.astype(jnp.uint8), v.astype(jnp.int16), v.astype(bool)), x)


@pytest.mark.parametrize("op", [
    lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), lambda x: x.astype(jnp.float16),
    lambda x: jax.lax.bitcast_convert_type(x, jnp.int32), lambda x: x.astype(jnp.int32).astype(jnp.float32),
    lambda x: jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=23),
])
def test_conversions_match_jax(op):
    _run(op, np.concatenate([F.ravel(), SPECIAL]))


@pytest.mark.parametrize("op", [
    lambda x: x.reshape(6, 4), lambda x: x[None, :, None], lambda x: jnp.squeeze(x[None]), lambda x: x.T,
    lambda x: jnp.broadcast_to(x[:, None, :], (4, 3, 6)), lambda x: x[::-1, ::2], lambda x: x[1:3, 2:5],
    lambda x: jnp.concatenate([x, x * 2, x[:1]], axis=0), lambda x: jnp.split(x, [1, 4], axis=1),
    lambda x: jnp.pad(x, ((1, 2), (0, 3))),
    lambda x: jax.lax.pad(x, 0.5, ((1, -1, 2), (-2, 3, 1))), lambda x: jax.lax.pad(x, 0.0, ((-1, -1, 0), (0, 0, 0))),
    lambda x: jnp.arange(24, dtype=jnp.float32).reshape(4, 6) + x, lambda x: jax.lax.iota(jnp.int32, 5),
    lambda x: jax.lax.broadcasted_iota(jnp.uint8, (3, 4), 1), lambda x: jnp.flip(x, (0, 1)),
    lambda x: jax.lax.dynamic_slice(x, (jnp.int32(2), jnp.int32(-3)), (2, 4)),
    lambda x: jax.lax.dynamic_slice(x, (jnp.int32(9), jnp.int32(4)), (3, 3)),
    lambda x: jax.lax.dynamic_update_slice(x, x[:2, :2] * 10, (jnp.int32(3), jnp.int32(5))),
    lambda x: jax.lax.dynamic_update_slice(x, x[:2, :3] * 10, (jnp.int32(-1), jnp.int32(1))),
    lambda x: jnp.where(x > 0, x, jnp.zeros_like(x)), lambda x: jax.lax.select_n(jnp.int32(1), x, x * 2),
    lambda x: jax.lax.select_n(jnp.arange(24).reshape(4, 6) % 3, x, -x, x * 2),
])
def test_data_movement_rules_match_jax(op):
    _run(op, F)


@pytest.mark.parametrize("op", [
    lambda x: x.sum(), lambda x: x.sum(0), lambda x: x.sum((0, 1)), lambda x: x.prod(1), lambda x: x.max(0),
    lambda x: x.min(1), lambda x: jnp.argmax(x, 1), lambda x: jnp.argmin(x, 0), lambda x: (x > 0).all(1),
    lambda x: (x > 0).any(0), lambda x: jnp.cumsum(x, 1), lambda x: jnp.cumprod(x, 0),
    lambda x: jax.lax.cummax(x, 1, reverse=True), lambda x: jax.lax.cummin(x, 0),
    lambda x: jax.lax.cumsum(x, 0, reverse=True), lambda x: jnp.sort(x, 1), lambda x: jnp.sort(x, 0),
    lambda x: jnp.argsort(x, 1), lambda x: jax.lax.sort((x, x * 2), dimension=1, num_keys=1),
    lambda x: jax.nn.softmax(x, -1), lambda x: jax.nn.logsumexp(x, 0), lambda x: jnp.mean(x) + jnp.var(x),
    lambda x: jnp.argmax(x.at[1, 2].set(jnp.nan), 1), lambda x: x.at[0, 0].set(jnp.nan).max(1),
])
def test_reduction_rules_match_jax(op):
    _run(op, F)


def test_sort_orders_nan_and_signed_zero_like_jax():
    x = np.array([[0.0, -0.0, np.nan, 1.0, -np.inf, -0.0, 0.0, np.nan, -1.0, np.inf]], np.float32)
    _run(lambda v: (jnp.sort(v, 1), jnp.argsort(v, 1)), x)
    _run(lambda v: jnp.argsort(v.astype(jnp.int32), 1), np.array([[3, 1, 3, -2, 1, 0]], np.float32))


@pytest.mark.parametrize("lhs_shape, rhs_shape, dims", [
    ((4, 5), (5, 3), (((1,), (0,)), ((), ()))),
    ((5, 4), (5, 3), (((0,), (0,)), ((), ()))),
    ((4, 5), (3, 5), (((1,), (1,)), ((), ()))),
    ((2, 4, 5), (2, 5, 3), (((2,), (1,)), ((0,), (0,)))),
    ((4, 2, 5), (3, 5, 2), (((2,), (1,)), ((1,), (2,)))),
    ((2, 3, 4), (3, 4, 2), (((1, 2), (0, 1)), ((), ()))),
    ((6,), (6,), (((0,), (0,)), ((), ()))),
])
def test_small_dot_general_matches_jax(lhs_shape, rhs_shape, dims):
    a = RNG.standard_normal(lhs_shape).astype(np.float32)
    b = RNG.standard_normal(rhs_shape).astype(np.float32)
    counts = _run(lambda x, y: jax.lax.dot_general(x, y, dims), a, b)
    assert counts.get("dot_general") == 1, counts


def test_large_dot_general_runs_through_xla():
    a = RNG.standard_normal((64, 128)).astype(np.float32)
    counts = check_equations(lambda x: x @ x.T, a)
    assert counts.get("jax:dot_general") == 1, counts


def test_windows_pooling_and_its_gradient_match_jax():
    x = RNG.standard_normal((2, 3, 9, 8)).astype(np.float32)
    x[0, 0, 0, :2] = 5.0  # ties: the first maximum must win

    def pools(v):
        m = jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 2, 2), ((0, 0), (0, 0), (1, 1), (0, 1)))
        s = jax.lax.reduce_window(v, 0.0, jax.lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
        n = jax.lax.reduce_window(v, jnp.inf, jax.lax.min, (1, 1, 2, 3), (1, 1, 1, 1), "SAME")
        return (m ** 2).sum() + s.sum() + n.sum()

    counts = _run(jax.grad(pools), x)
    assert counts.get("select_and_scatter_add", 0) >= 1, counts


def test_dynamic_update_slice_in_place_is_right():
    closed = jax.make_jaxpr(lambda x, u, i, j: jax.lax.dynamic_update_slice_p.bind(x, u, i, j))(
        F, F[:2], np.int32(1), np.int32(0))
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "dynamic_update_slice"]
    kernel = kernel_for(eqn)
    assert kernel.name == "numpy" and 0 in kernel.alias_ok
    for start in (1, 3, -2):  # clamped into range as XLA does
        x = F.copy()
        kernel.into(x, x, F[:2] * 7, np.int32(start), np.int32(0))  # out is the operand's own memory
        # the primitive itself, not lax's wrapper (which first wraps negative starts like Python)
        want = np.asarray(jax.jit(jax.lax.dynamic_update_slice_p.bind)(F, F[:2] * 7, np.int32(start), np.int32(0)))
        np.testing.assert_array_equal(x, want)


def test_unknown_and_unruled_primitives_fall_back_to_jax():
    # gather, scatter-add, conv, PRNG, cumlogsumexp, top_k: all run, through JAX when numpy has no rule
    key = jax.random.key(3)

    def f(x, k):
        idx = jnp.array([3, 0, 2])
        g = x[idx] + jnp.take_along_axis(x, jnp.argsort(x, 1)[:, :2], 1).sum()
        s = jnp.zeros((5, 6)).at[idx].add(x[:3])
        c = jax.lax.conv_general_dilated(x[None, None], jnp.ones((2, 1, 2, 2)), (1, 1), "SAME")
        r = jax.random.normal(k, (4, 6)) + jax.random.uniform(jax.random.PRNGKey(1), (4, 6))
        t = jax.lax.top_k(x, 2)[0]
        return g, s, c, r, t, jax.lax.cumlogsumexp(x, 0), jax.random.split(k)

    counts = check_equations(f, F, key)
    assert counts.get("jax:gather") and counts.get("jax:conv_general_dilated") and counts.get("jax:random_bits")


def test_every_rule_name_is_a_string_table_entry():
    # the table is keyed by primitive name and each entry builds a kernel or declines (None)
    assert {"add", "dot_general", "reduce_sum", "select_and_scatter_add", "dynamic_update_slice"} <= set(KERNELS)
    eqn = jax.make_jaxpr(lambda x: jnp.sin(x))(F).jaxpr.eqns[0]
    assert kernel_for(eqn).name == "numpy" and jax_kernel(eqn).name == "jax"


def test_large_elementwise_ops_split_across_threads_stay_right():
    # Outputs past PARALLEL_SIZE are cut into pieces per thread; in place (the operand's own
    # memory) that is still element for element, and an operand that overlaps the output any
    # other way (a transposed view of it) must not be split.
    from jaxmem.execution import primitives

    n = 1024
    x = RNG.standard_normal((n, n)).astype(np.float32)
    eqn = jax.make_jaxpr(lambda a, b: a * b)(x, x).jaxpr.eqns[0]
    kernel = kernel_for(eqn)
    assert primitives.THREADS == 1 or kernel.ufunc is None  # the threaded kernel, not the bare ufunc
    want = x * x.T
    buf = x.copy()
    kernel.into(buf, buf, buf.T)          # out overlaps a transposed operand
    np.testing.assert_array_equal(buf, want)
    buf = x.copy()
    kernel.into(buf, buf, np.float32(3))  # in place
    np.testing.assert_array_equal(buf, x * np.float32(3))
    np.testing.assert_array_equal(kernel.compute(x, x[:1]), x * x[:1])
