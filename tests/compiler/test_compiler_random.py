"""Random small programs (hypothesis): every plan is valid and, run in a patterned host arena,
gives what JAX's own interpreter gives, with and without donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.extend.core import jaxpr_as_fun

from compiler_helpers import run_in_arena
from jaxmem.compiler.checker import check_plan
from jaxmem.compiler.planner import plan

UNARY = {"sin": jnp.sin, "exp": lambda a: jnp.exp(-a * a), "tanh": jnp.tanh, "neg": jnp.negative,
         "T": lambda a: a.T, "flat": lambda a: (a.reshape(-1) * 2).reshape(8, 8),
         "rowsum": lambda a: jnp.broadcast_to(a.sum(axis=1, keepdims=True), (8, 8)),
         "half": lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)}
BINARY = {"add": jnp.add, "mul": jnp.multiply, "sub": jnp.subtract, "dot": lambda a, b: a @ b / 8,
          "dus": lambda a, b: jax.lax.dynamic_update_slice(a, b[:4], (2, 0)),
          "scan": lambda a, b: jax.lax.scan(lambda c, r: (jnp.tanh(c + r), c * r), a[0], b)[1],
          "cond": lambda a, b: jax.lax.cond(a[0, 0] > 0, lambda x, y: x * y, lambda x, y: x - y, a, b)}

op = st.one_of(
    st.tuples(st.sampled_from(sorted(UNARY)), st.integers(0, 99)),
    st.tuples(st.sampled_from(sorted(BINARY)), st.integers(0, 99), st.integers(0, 99)),
)


def _build(ops, n_inputs, outs):
    def program(*inputs):
        vals = list(inputs)
        for item in ops:
            name, *idx = item
            args = [vals[i % len(vals)] for i in idx]
            vals.append(UNARY[name](*args) if name in UNARY else BINARY[name](*args))
        return tuple(vals[i % len(vals)] for i in outs)
    return program


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op, min_size=1, max_size=10),
    n_inputs=st.integers(1, 3),
    outs=st.lists(st.integers(0, 99), min_size=1, max_size=3),
    donate=st.lists(st.booleans(), min_size=3, max_size=3),
)
def test_random_programs_plan_validly_and_run_correctly(ops, n_inputs, outs, donate):
    fn = _build(ops, n_inputs, outs)
    rng = np.random.default_rng(len(ops))
    inputs = [jnp.asarray(rng.standard_normal((8, 8), dtype=np.float32)) for _ in range(n_inputs)]
    donate_argnums = tuple(k for k in range(n_inputs) if donate[k])
    p = plan(fn, *inputs, donate_argnums=donate_argnums, xla=False)
    assert check_plan(p) == [], p.problems
    assert p.valid and p.peak_bytes >= p.lower_bound_bytes
    got = run_in_arena(p, inputs)
    want = jaxpr_as_fun(p.closed_jaxpr)(*inputs)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
