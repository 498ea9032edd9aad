"""The front end: call-like primitives inlined once, source lines, donation flattening."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.jaxpr_adapter import inline
from jaxmem.compiler.program import drop_dead
from jaxmem.compiler.plan_types import SourceLine


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
