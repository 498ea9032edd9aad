"""Issue 12: fit's site finding does not depend on how the user imported JAX's gradient
functions (`from jax import grad, value_and_grad, vjp` done before fit runs), and its
`sys.settrace` hook coexists with a debugger's or coverage's trace function. Totals are checked
against XLA:CPU's memory_analysis() of the same checkpoint written by hand; values against
`jax.jit` of the original."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import grad, value_and_grad, vjp  # bound by name at import, before any fit runs

from jaxmem.fitting.policy import find_sites, with_policy
from jaxmem.xla.cpu.compile import xla_reference

RNG = np.random.default_rng(1)
WS = jnp.asarray(RNG.standard_normal((4, 64, 64), dtype=np.float32) / 8)
X = jnp.asarray(RNG.standard_normal((256, 64), dtype=np.float32))
POLICY = jax.checkpoint_policies.nothing_saveable


def loss(ws, x):
    for w in ws:
        x = jnp.tanh(jnp.sin(x @ w))
    return jnp.mean(x ** 2)


def grad_step(ws, x):
    return ws - 0.1 * grad(loss)(ws, x)


def value_and_grad_step(ws, x):
    value, g = value_and_grad(loss)(ws, x)
    return value, ws - 0.1 * g


def vjp_step(ws, x):
    value, pull = vjp(loss, ws, x)
    return value, ws - 0.1 * pull(jnp.ones((), jnp.float32))[0]


def _by_hand(step):
    """The same step with the checkpoint the user would write around `loss`."""
    fitted = jax.checkpoint(loss, policy=POLICY)
    return {"grad_step": lambda ws, x: ws - 0.1 * grad(fitted)(ws, x),
            "value_and_grad_step": lambda ws, x: (lambda v, g: (v, ws - 0.1 * g))(*value_and_grad(fitted)(ws, x)),
            "vjp_step": lambda ws, x: (lambda v, p: (v, ws - 0.1 * p(jnp.ones((), jnp.float32))[0]))(
                *vjp(fitted, ws, x))}[step.__name__]


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


def test_grad_functions_imported_by_name_are_sites_and_take_the_policy():
    from jax._src import api

    assert grad is api.grad and value_and_grad is api.value_and_grad  # JAX's own objects, not jaxmem's
    for step in (grad_step, value_and_grad_step, vjp_step):
        sites = find_sites(step, (WS, X))
        (site,) = [s for s in sites if s.kind == "grad"]
        assert site.function == "loss" and site.call.function == step.__name__, step.__name__
        assert site.call.line > step.__code__.co_firstlineno
        assert [s.kind for s in sites if s.kind == "loop"] == ["loop"]   # the body of `loss` was traced
        fitted = with_policy(step, "nothing_saveable", ("grad",))
        assert str(jax.make_jaxpr(fitted)(WS, X)).count("remat") == 1
        assert str(jax.make_jaxpr(step)(WS, X)).count("remat") == 0
        # What fit applied is what the user would write: the same XLA program size, the same values.
        hand = _by_hand(step)
        assert xla_reference(fitted, (WS, X)).total_bytes == xla_reference(hand, (WS, X)).total_bytes
        _close(jax.jit(step)(WS, X), jax.jit(fitted)(WS, X))
    # Outside a fit the functions are JAX's, untouched: no checkpoint appears.
    assert str(jax.make_jaxpr(grad_step)(WS, X)).count("remat") == 0


class Recorder:
    """A debugger-like trace function: a global one that returns itself as the local one for
    this file's frames, recording (function, event, line)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename != __file__:
            return None
        self.events.append((frame.f_code.co_name, event, frame.f_lineno))
        return self


def _lines(events, function):
    return {(e, line) for f, e, line in events if f == function}


def test_a_trace_function_installed_before_keeps_its_events_and_is_restored():
    plain = Recorder()
    sys.settrace(plain)
    try:
        jax.make_jaxpr(lambda *a: value_and_grad_step(*a))(WS, X)   # without fit (a fresh function: no trace cache)
    finally:
        sys.settrace(None)
    assert _lines(plain.events, "loss")

    rec = Recorder()

    def region():  # a frame the recorder traces, running before fit's hook and after it
        # `loss` runs once, traced under fit's own hook, its loop iterations checkpointed.
        closed = jax.make_jaxpr(with_policy(value_and_grad_step, "nothing_saveable", ("loop",)))(WS, X)
        after = sys.gettrace()
        return str(closed).count("remat"), after, len(rec.events), sys._getframe().f_lineno

    sys.settrace(rec)
    try:
        remats, after, marker, here = region()
    finally:
        sys.settrace(None)
    assert after is rec                                       # restored once fit's tracing ended
    assert remats == 4                                        # fit still found its loop site
    # Every call, line and return event of `loss` the recorder sees alone, it saw under fit.
    assert _lines(plain.events, "loss") <= _lines(rec.events, "loss")
    assert ("loss", "call", loss.__code__.co_firstlineno) in rec.events
    # The local trace function of a frame that was running when fit's hook went on still runs.
    assert ("region", "line", here) in rec.events[marker - 1:]
