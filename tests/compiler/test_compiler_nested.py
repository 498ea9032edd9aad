"""Nested jaxprs: calls are inlined into the schedule; scan/while/cond are one step with scratch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxmem.compiler.checker import check_plan
from jaxmem.compiler.jaxpr_adapter import CALL_PRIMITIVES
from jaxmem.compiler.planner import plan

N = 4096  # elements: 16 KiB per f32 vector, well above the 256-byte granularity


def _valid(p):
    assert check_plan(p) == []
    assert p.valid
    return p


@jax.custom_jvp
def _cjvp(x):
    return jnp.sin(x) * 3


_cjvp.defjvp(lambda p, t: (_cjvp(p[0]), 3 * jnp.cos(p[0]) * t[0]))


@jax.custom_vjp
def _cvjp(x):
    return jnp.exp(x) + 1


_cvjp.defvjp(lambda x: (_cvjp(x), x), lambda x, g: (g * jnp.exp(x),))


@pytest.mark.parametrize("wrap", ["jit", "custom_jvp", "custom_vjp", "checkpoint", "closed_call"])
def test_call_primitives_are_inlined(wrap):
    inner = {
        "jit": jax.jit(lambda x: jnp.tanh(x) * 2),
        "custom_jvp": _cjvp,
        "custom_vjp": _cvjp,
        "checkpoint": jax.checkpoint(lambda x: jnp.tanh(x) * 2),
        "closed_call": lambda x: jax.jit(jax.jit(lambda y: y * 5))(x),
    }[wrap]

    def f(x):
        return inner(x) + x

    x = jnp.ones(N)
    p = _valid(plan(f, x, xla=False))
    prims = [s.primitive for s in p.schedule]
    assert not set(prims) & CALL_PRIMITIVES, prims
    assert "add" in prims
    # The eqns of the inlined body are in the schedule, with this file as their source.
    assert all(s.source is not None and s.source.file == __file__ for s in p.schedule)
    # Its gradient (which runs the custom rules) plans too.
    g = _valid(plan(jax.grad(lambda x: f(x).sum()), x, xla=False))
    assert not {s.primitive for s in g.schedule} & CALL_PRIMITIVES


def test_scan_is_one_step_and_carry_reuses_dying_init():
    w = jnp.eye(1024) * 0.5

    def f(c0, xs):
        c0 = c0 * 2  # a temporary that dies in the scan: the carry may take it over
        # The new carry is a dot of the old one: it needs a temporary while the old is read.
        return jax.lax.scan(lambda c, x: (jnp.tanh(w @ c) + x, c * x), c0, xs)

    p = _valid(plan(f, jnp.ones(1024), jnp.ones((8, 1024)), xla=False))
    scans = [s for s in p.schedule if s.primitive == "scan"]
    assert len(scans) == 1
    step = scans[0]
    carry_in, carry_out = step.operands[step.eqn.params["num_consts"]], step.outputs[0]
    assert p.values[carry_out].buffer == p.values[carry_in].buffer
    assert step.scratch_bytes >= 1024 * 4


def test_loop_body_temporaries_count_once_whatever_the_trip_count():
    w = jnp.eye(256) * 0.5

    def make(length):
        def f(x):
            step = lambda s: (s[0] + 1, jnp.tanh(w @ s[1]) + s[1])
            return jax.lax.while_loop(lambda s: s[0] < length, step, (0, x))[1]
        return f

    x = jnp.ones((256, 64))
    short, long = (_valid(plan(make(n), x, xla=False)) for n in (2, 2000))
    assert short.peak_bytes == long.peak_bytes
    (loop,) = [s for s in long.schedule if s.primitive == "while"]
    # The new carry is computed while the old one is still read by the dot: one carry's bytes.
    assert loop.scratch_bytes >= 256 * 64 * 4


def test_cond_needs_its_larger_branch():
    big = 512

    def heavy(v):
        return (jnp.outer(v, v) @ jnp.ones(big))  # a (big, big) temporary

    def light(v):
        return v * 2

    def f(p, v):
        return jax.lax.cond(p > 0, heavy, light, v)

    def g(p, v):
        return jax.lax.cond(p > 0, light, heavy, v)

    args = (jnp.float32(1.0), jnp.ones(big))
    pf, pg = (_valid(plan(h, *args, xla=False)) for h in (f, g))
    (cf,) = [s for s in pf.schedule if s.primitive == "cond"]
    (cg,) = [s for s in pg.schedule if s.primitive == "cond"]
    assert cf.scratch_bytes == cg.scratch_bytes >= big * big * 4
    assert pf.peak_bytes == pg.peak_bytes >= big * big * 4


def test_while_and_cond_with_nested_calls_plan_and_count_equations():
    def body(c):
        return jax.jit(lambda y: jnp.sin(y) + 1)(c)

    def f(x):
        y = jax.lax.while_loop(lambda c: c[0] < 10, body, x)
        return jax.lax.cond(y[0] > 0, lambda a: a * 2, lambda a: jax.checkpoint(jnp.cos)(a), y)

    p = _valid(plan(f, jnp.ones(N), xla=False))
    assert [s.primitive for s in p.schedule if s.primitive in ("while", "cond")] == ["while", "cond"]
    closed = jax.make_jaxpr(f)(jnp.ones(N))
    assert p.num_eqns > len(closed.jaxpr.eqns)  # nested equations are counted


def _scan_stack(xs, w):
    def body(h, x):
        h = jnp.tanh(h @ w + x)
        return h, h * 2

    h, ys = jax.lax.scan(body, jnp.zeros((64, 64)), xs)
    return h.sum() + ys.sum()


def _while_then_cond(x):
    y = jax.lax.fori_loop(0, 5, lambda i, c: jnp.sin(c) * 2 + c, x)
    return jax.lax.cond(y.sum() > 0, lambda v: jnp.exp(v) @ v, lambda v: v @ v.T, y)


@pytest.mark.parametrize("case", ["scan", "scan_grad", "while_cond", "suite_rnn"])
def test_loop_body_plans_are_valid(case, monkeypatch):
    """Each loop or branch body is planned on its own with its results written into the loop's
    buffers outside it (`external_outputs`); the checker must accept those plans too."""
    from jaxmem.compiler import planner

    bodies = []
    real = planner.plan_jaxpr

    def checked(jaxpr, **kw):
        kw["check"] = True
        p = real(jaxpr, **kw)
        bodies.append(p)
        return p

    if case == "suite_rnn":
        from jaxmem.examples.suite import ALL_PROGRAMS
        fn, args = ALL_PROGRAMS["rnn_scan_grad"].factory()
    elif case == "while_cond":
        fn, args = _while_then_cond, (jnp.ones((64, 64)),)
    else:
        fn, args = _scan_stack, (jnp.ones((6, 64, 64)), jnp.ones((64, 64)) * 0.01)
        if case == "scan_grad":
            fn = jax.grad(fn, argnums=1)
    closed = jax.make_jaxpr(fn)(*args)
    monkeypatch.setattr(planner, "plan_jaxpr", checked)
    top = real(closed)
    monkeypatch.undo()
    assert top.valid
    nested = [p for p in bodies if p.external_outputs]
    assert nested, "no loop body was planned with its results outside"
    for p in bodies:
        assert p.problems == [] and p.valid
