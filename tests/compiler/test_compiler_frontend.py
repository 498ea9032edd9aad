"""The front end: call-like primitives inlined once, source lines, donation flattening."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.jaxpr_adapter import inline
from jaxmem.compiler.program import drop_dead
from jaxmem.compiler.plan_types import SourceLine
from jaxmem.errors import PlanError


def test_an_equation_without_a_user_frame_after_a_call_gets_no_jaxpr_variable(monkeypatch):
    # An equation whose traceback has no user frame (here: the `mul`) after an inlined call
    # once got the call's last output variable as its source line.
    real = ja.source_line
    monkeypatch.setattr(ja, "source_line", lambda eqn: None if ja.eqn_name(eqn) == "mul" else real(eqn))
    closed = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x) * 2)(jnp.ones(4))
    g = drop_dead(inline(closed))
    assert [op.primitive for op in g.ops] == ["sin", "mul"]
    for op in g.ops:
        assert op.source is None or isinstance(op.source, SourceLine), op.source
    assert all(s is None or isinstance(s, SourceLine) for s in g.sources)


def _relu_layer(x, w):
    return jnp.tanh(jax.nn.relu(x @ w)).sum()


_ARGS = (np.ones((8, 8), np.float32), np.ones((8, 8), np.float32))


def test_planner_remat_and_executor_read_one_program():
    from jaxmem.compiler.remat_graph import trace as remat_trace

    program = inline(ja.trace(_relu_layer, _ARGS).closed_jaxpr)
    graph = remat_trace(_relu_layer, *_ARGS)
    assert [op.primitive for op in graph.ops] == [op.primitive for op in program.ops]
    sources = [program.sources[v] for op in program.ops for v in op.outputs if v is not None]
    assert [graph.program.sources[v] for op in graph.ops for v in op.outputs if v is not None] == sources
    # jax.nn.relu's body (a jitted library call) has no user frame: its caller's line stands in
    assert all(s is not None and s.file == __file__ and s.function == "_relu_layer" for s in sources)
    assert ja.user_frames(program.ops[0].eqn)[0][:1] == (__file__,)


@pytest.mark.parametrize("entry", ["plan", "jit", "fit"])
def test_donation_and_tracing_errors_are_one_plan_error_everywhere(entry):
    import jaxmem
    from jaxmem.fitting.fit import fit

    def call(fn, donate):
        if entry == "plan":
            return jaxmem.plan(fn, *_ARGS, donate_argnums=donate, xla=False)
        if entry == "jit":
            return jaxmem.jit(fn, donate_argnums=donate)(*_ARGS)
        return fit(fn, *_ARGS, budget="1GiB", donate_argnums=donate)

    with pytest.raises(PlanError, match="donate_argnums"):
        call(_relu_layer, (2,))

    def broken(x, w):
        raise ValueError("not traceable\nsecond line")

    with pytest.raises(PlanError, match="cannot trace 'broken': ValueError: not traceable$"):
        call(broken, ())


def test_donated_flat_counts_leaves_and_accepts_negative_indices():
    args = ({"a": np.ones(2), "b": np.ones(3)}, np.ones(4), [np.ones(1)] * 3)
    assert ja.donated_flat(args, (0, -1)) == (0, 1, 3, 4, 5)
    assert ja.donate_positions(3, 1) == (1,)
