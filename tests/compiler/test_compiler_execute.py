"""Plans run for real: every program executes in a host arena at its planned offsets and gives
JAX's own results, so two live values sharing bytes would show up as wrong numbers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxpr_as_fun

from compiler_helpers import run_in_arena
from jaxmem.compiler.checker import check_plan
from jaxmem.compiler.planner import plan
from jaxmem.examples import cnn, control, gpt, mlp, rnn


def _nested(x, y):
    @jax.custom_jvp
    def f(a):
        return jnp.sin(a)

    f.defjvp(lambda p, t: (f(p[0]), jnp.cos(p[0]) * t[0]))

    @jax.custom_vjp
    def g(a):
        return a * 2

    g.defvjp(lambda a: (g(a), None), lambda r, c: (c * 2,))
    z = jax.jit(lambda a: a + 1)(x)
    z = f(z) + g(z)
    z = jax.checkpoint(lambda a: jnp.sin(a) * 2)(z)
    c, ys = jax.lax.scan(lambda c, a: (c + a, c * a), z, y)
    w = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 2), (0, z))
    q = jax.lax.cond(x[0] > 0, lambda a: jnp.tanh(a) + 1, lambda a: a * 3, z)
    return c, ys, w, q, 3.0


# Running eagerly compiles every distinct primitive/shape once, so the training steps with
# hundreds of distinct equations take tens of seconds each: they run with -m slow.
FAST = {
    "nested": lambda: (_nested, (jnp.linspace(0.1, 1.0, 512), jnp.ones((5, 512))), ()),
    "mlp_train_donated": lambda: (*mlp.make_train_step(depth=1, width=64, in_dim=32, classes=10, batch=16), (0, 1)),
    "rnn_grad": lambda: (*rnn.make_loss_and_grad(batch=4, seq=5, in_dim=8, hidden=16), ()),
    "while_cond": lambda: (*control.make_while_cond(n=64, k=8), ()),
    "parallel": lambda: (*control.make_parallel_branches(batch=16, in_dim=32, width=64, branches=3, depth=2), ()),
}
SLOW = {
    "gpt_forward": lambda: (*gpt.make_forward(n_layers=1, d_model=64, n_heads=4, seq=16, batch=2, vocab=128), ()),
    "mlp_train": lambda: (*mlp.make_train_step(depth=3, width=128, in_dim=64, classes=10, batch=32), ()),
    "gpt_train": lambda: (*gpt.make_train_step(n_layers=2, d_model=64, n_heads=4, seq=16, batch=2, vocab=128), ()),
    "gpt_train_donated": lambda: (*gpt.make_train_step(n_layers=2, d_model=64, n_heads=4, seq=16, batch=2, vocab=128), (0, 1)),
    "cnn_train": lambda: (*cnn.make_train_step(batch=2, size=8, channels=(4, 8), classes=3), ()),
}
PROGRAMS = {**FAST, **SLOW}
CASES = [pytest.param(name) for name in FAST] + [pytest.param(name, marks=pytest.mark.slow) for name in SLOW]


@pytest.mark.parametrize("name", CASES)
def test_plan_runs_in_arena_and_matches_jax(name):
    fn, args, donate = PROGRAMS[name]()
    p = plan(fn, *args, donate_argnums=donate, xla=False)
    assert check_plan(p) == [], p.problems
    assert p.valid
    assert p.peak_bytes >= p.lower_bound_bytes
    flat_args = jax.tree_util.tree_leaves(args)
    got = run_in_arena(p, flat_args)
    # JAX's own interpreter on the same jaxpr: the same primitives, so the same rounding.
    want = jaxpr_as_fun(p.closed_jaxpr)(*flat_args)
    assert len(got) == len(want)
    for k, (a, b) in enumerate(zip(got, want)):
        if a is None:  # a literal output: nothing planned for it
            continue
        # Only calls the planner inlined (jit) run compiled in the reference, which may round
        # differently; a buffer clobbered by another gives the fill pattern or garbage instead.
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale + 1e-7, err_msg=f"{name}: output {k}")


@pytest.mark.parametrize("name", ["mlp_train_donated", pytest.param("gpt_train", marks=pytest.mark.slow)])
def test_argument_and_output_bytes_match_xla(name):
    fn, args, donate = PROGRAMS[name]()
    p = plan(fn, *args, donate_argnums=donate, xla=False)
    stats = jax.jit(fn, donate_argnums=donate).lower(*args).compile().memory_analysis()
    assert p.argument_bytes == stats.argument_size_in_bytes
    # XLA also counts the output tuple's table of pointers, 8 bytes per element.
    n_out = len(jax.tree_util.tree_leaves(jax.eval_shape(fn, *args)))
    assert p.output_bytes == stats.output_size_in_bytes - (8 * n_out if n_out > 1 else 0)
