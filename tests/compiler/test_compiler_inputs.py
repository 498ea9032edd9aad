"""Donation, unknown primitives, literals and constants, bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive

import jaxmem
from compiler_helpers import run_in_arena
from jaxmem.compiler.checker import check_plan
from jaxmem.compiler.planner import plan
from jaxmem.errors import PlanError

N = 4096


def _adam_like(p, m, g):
    m = 0.9 * m + 0.1 * g
    return p - 0.01 * m, m


def test_donated_arguments_live_in_the_arena_and_outputs_take_them_over():
    args = (jnp.ones(N), jnp.zeros(N), jnp.full(N, 0.5))
    kept = plan(_adam_like, *args, xla=False)
    donated = plan(_adam_like, *args, donate_argnums=(0, 1), xla=False)
    for p in (kept, donated):
        assert check_plan(p) == [] and p.valid
    assert donated.donated == (0, 1)
    for k in (0, 1):
        info = donated.values[donated.invars[k]]
        buf = donated.buffers[info.buffer]
        assert buf.kind == "argument" and buf.start == -1
    assert kept.values[kept.invars[0]].buffer is None  # stays in the caller's memory
    # Each output is written in place into a donated argument of its shape (XLA's aliasing).
    arg_buffers = {donated.values[v].buffer for v in donated.invars[:2]}
    assert {donated.values[v].buffer for v in donated.outvars} == arg_buffers
    assert donated.peak_bytes < kept.peak_bytes
    assert donated.peak_bytes == 3 * N * 4  # the two donated states and g: nothing else
    out = run_in_arena(donated, list(args))
    want = _adam_like(*args)
    for a, b in zip(out, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_bad_donate_argnums_is_a_plan_error():
    with pytest.raises(PlanError, match="donate_argnums"):
        plan(_adam_like, jnp.ones(4), jnp.ones(4), jnp.ones(4), donate_argnums=(3,), xla=False)


def test_untraceable_function_is_a_one_line_plan_error():
    def broken(x):
        return x @ jnp.ones((3, 5))  # shapes do not match

    with pytest.raises(PlanError) as info:
        plan(broken, jnp.ones((2, 4)), xla=False)
    assert "\n" not in str(info.value)


_mystery = Primitive("jaxmem_test_mystery")
_mystery.def_impl(lambda x, y: np.asarray(x) * 2 + np.asarray(y).sum())
_mystery.def_abstract_eval(lambda x, y: jax.core.ShapedArray(x.shape, x.dtype))


def test_unknown_primitive_is_planned_conservatively_and_named():
    def f(x, y):
        a = jnp.sin(x)
        b = _mystery.bind(a, y)
        return jnp.cos(b) + a

    x, y = jnp.linspace(0, 1, N), jnp.ones(N)
    p = plan(f, x, y, xla=False)
    assert check_plan(p) == [] and p.valid
    assert p.unknown_primitives == ["jaxmem_test_mystery"]
    (step,) = [s for s in p.schedule if s.primitive == "jaxmem_test_mystery"]
    out = step.outputs[0]
    assert p.values[out].buffer is not None
    # Its output is a fresh buffer, disjoint from every input it reads.
    for v in step.inputs:
        if p.values[v].buffer is not None:
            assert p.values[v].buffer != p.values[out].buffer
    np.testing.assert_allclose(run_in_arena(p, [x, y])[0], f(x, y), rtol=1e-5)


def test_literals_and_closed_over_constants():
    table = np.arange(N, dtype=np.float32)

    def f(x):
        return x * 3.0 + table, 7.0, x

    x = jnp.ones(N)
    p = plan(f, x, xla=False)
    assert check_plan(p) == [] and p.valid
    assert p.outvars[1] is None  # a literal output has no value
    assert p.outvars[2] == p.invars[0]  # an input returned as is stays where it is
    consts = [o for s in p.schedule for o in s.operands if not isinstance(o, int)]
    assert any(np.asarray(c.value).shape == (N,) for c in consts)  # the closed-over table
    assert any(np.asarray(c.value).shape == () for c in consts)    # the literal 3.0
    got = run_in_arena(p, [x])
    np.testing.assert_allclose(got[0], np.asarray(f(x)[0]))
    assert p.output_bytes == N * 4 + 4 + N * 4


def test_dead_code_is_not_planned():
    def f(x):
        _ = jnp.exp(x) @ jnp.ones((N, N // 4))  # unused: XLA removes it too
        return x + 1

    p = plan(f, jnp.ones(N), xla=False)
    assert check_plan(p) == [] and p.valid
    assert [s.primitive for s in p.schedule] == ["add"]


def test_long_elementwise_chain_fuses_without_recursion_limits():
    def f(x):
        for _ in range(3000):  # deeper than Python's recursion limit
            x = x * 1.0001 + 0.5
        return x

    p = plan(f, jnp.ones(N), xla=False)
    assert check_plan(p) == [] and p.valid
    # Every intermediate but the output is recomputed inside the next op: nothing is stored
    # besides the output (and the input, in the caller's memory).
    assert p.peak_bytes == p.lower_bound_bytes == 2 * N * 4


def test_plan_records_xla_figures_for_the_same_function():
    args = (jnp.ones(N), jnp.zeros(N), jnp.full(N, 0.5))
    assert plan(_adam_like, *args, donate_argnums=(0,)).xla is None  # the compiler compiles nothing
    p = jaxmem.plan(_adam_like, *args, donate_argnums=(0,))          # the public plan adds XLA's figures
    assert p.xla is not None
    assert p.xla.argument_bytes == p.argument_bytes  # every argument is used
    assert p.xla.output_bytes - 16 == p.output_bytes  # XLA adds the 2-tuple's pointer table
    assert p.xla.alias_bytes == N * 4                 # the donated argument, aliased to an output


def test_source_lines_point_at_user_code_including_bundled_examples():
    from jaxmem.examples import mlp

    fn, args = mlp.make_train_step(depth=1, width=64, in_dim=32, classes=10, batch=16)
    p = plan(fn, *args, xla=False)
    files = [s.source.file for s in p.schedule if s.source is not None]
    # Never a frame of JAX itself; nearly every step is attributed to the example's own files.
    assert not any("/jax/" in f or "/jaxlib/" in f for f in files)
    assert len(files) >= 0.9 * len(p.schedule)
    assert all("/jaxmem/examples/" in f for f in files)
