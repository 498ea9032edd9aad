"""Issue 12: checkpoint sites that do not depend on how the model is written: layers called
from a Python loop (functions, closures, methods), `scan` imported by name, static `fori_loop`,
and a site context that another thread tracing at the same time does not see. Values are
checked against JAX's own `jax.jit` of the original; totals against XLA's memory_analysis()."""

from __future__ import annotations

import threading
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.lax import scan  # imported by name before any site context: still a site

from jaxmem.fitting.policy import find_sites, layer_line, with_policy
from jaxmem.fitting.sites import checkpoint_sites
from jaxmem.xla.cpu.compile import xla_reference

RNG = np.random.default_rng(0)
WS = jnp.asarray(RNG.standard_normal((4, 32, 32), dtype=np.float32) / 6)
X = jnp.asarray(RNG.standard_normal((128, 32), dtype=np.float32))


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-5, atol=2e-6)


def _step(loss):
    def step(ws, x):
        value, g = jax.value_and_grad(loss)(ws, x)
        return value, ws - 0.1 * g
    return step


def block(w, h, scale):
    return jnp.tanh(jnp.sin(h @ w) * scale)


def loop_loss(ws, x):
    for w in ws:
        x = block(w, x, 2.0)
    return jnp.mean(x ** 2)


class Model:
    def layer(self, w, h):
        return jnp.tanh(jnp.sin(h @ w))

    def loss(self, ws, x):
        for w in ws:
            x = self.layer(w, x)
        return jnp.mean(x ** 2)


def scan_loss(ws, x):
    def body(h, w):
        return jnp.tanh(jnp.sin(h @ w)), None
    h, _ = scan(body, x, ws)
    return jnp.mean(h ** 2)


def fori_loss(ws, x):
    return jnp.mean(jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(jnp.sin(h @ ws[i])), x) ** 2)


def _remats(fn):
    return str(jax.make_jaxpr(fn)(WS, X)).count("remat")


def test_python_loop_layer_is_a_site_printed_as_the_user_writes_it():
    sites = find_sites(_step(loop_loss), (WS, X))
    layer = [s for s in sites if s.kind == "layer"]
    assert len(layer) == 1 and layer[0].function == "block" and layer[0].calls == 4
    assert layer[0].call.function == "loop_loss" and layer[0].static == (2,)
    line = layer_line(layer[0], "P")
    assert line == "x = jax.checkpoint(block, policy=P, static_argnums=2)(w, x, 2.0)"
    # What it says to write, written by hand, is the same program for XLA and the same values.
    def by_hand(ws, x):
        for w in ws:
            x = jax.checkpoint(block, policy=jax.checkpoint_policies.nothing_saveable, static_argnums=2)(w, x, 2.0)
        return jnp.mean(x ** 2)

    fitted = with_policy(_step(loop_loss), "nothing_saveable", ("layer",))
    assert _remats(fitted) == 4 and _remats(_step(loop_loss)) == 0
    assert xla_reference(fitted, (WS, X)).total_bytes == xla_reference(_step(by_hand), (WS, X)).total_bytes
    _close(jax.jit(_step(loop_loss))(WS, X), jax.jit(fitted)(WS, X))


def test_methods_and_closures_called_in_a_loop_are_layer_sites():
    model = Model()
    sites = find_sites(_step(model.loss), (WS, X))
    layer = [s for s in sites if s.kind == "layer"]
    assert [s.function for s in layer] == ["layer"] and layer[0].callee == "self.layer"
    assert layer_line(layer[0], "P") == "x = jax.checkpoint(self.layer, policy=P)(w, x)"
    fitted = with_policy(_step(model.loss), "dots_saveable", ("layer",))
    _close(jax.jit(_step(model.loss))(WS, X), jax.jit(fitted)(WS, X))

    def closure_loss(ws, x):
        act = partial(jnp.maximum, 0.0)

        def mlp(h, w):
            return act(h @ w) + h
        for w in ws:
            x = mlp(x, w)
        return jnp.mean(x ** 2)

    layer = [s for s in find_sites(_step(closure_loss), (WS, X)) if s.kind == "layer"]
    assert [s.function for s in layer] == ["mlp"]
    fitted = with_policy(_step(closure_loss), "nothing_saveable", ("layer",))
    assert _remats(fitted) == 4
    _close(jax.jit(_step(closure_loss))(WS, X), jax.jit(fitted)(WS, X))


def test_scan_imported_by_name_and_static_fori_loop_are_scan_sites():
    for loss, traced_for in ((scan_loss, "scan"), (fori_loss, "fori_loop")):
        step = _step(loss)
        scans = [s for s in find_sites(step, (WS, X)) if s.kind == "scan"]
        assert len(scans) == 1 and scans[0].traced_for == traced_for, loss.__name__
        assert scans[0].call.function == loss.__name__
        # Where the body is defined, as fit prints it ("# the scan body defined at file:line").
        body_line = scan_loss.__code__.co_firstlineno + 1 if loss is scan_loss else fori_loss.__code__.co_firstlineno + 1
        assert scans[0].defined == f"{__file__}:{body_line}", scans[0].defined
        fitted = with_policy(step, "nothing_saveable", ("scan",))
        assert _remats(fitted) >= 1 and _remats(step) == 0
        _close(jax.jit(step)(WS, X), jax.jit(fitted)(WS, X))

    def by_hand(ws, x):
        def body(h, w):
            return jnp.tanh(jnp.sin(h @ w)), None
        h, _ = scan(jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable), x, ws)
        return jnp.mean(h ** 2)

    fitted = with_policy(_step(scan_loss), "nothing_saveable", ("scan",))
    assert xla_reference(fitted, (WS, X)).total_bytes == xla_reference(_step(by_hand), (WS, X)).total_bytes


def test_a_thread_outside_the_site_context_sees_jax_own_grad():
    inside, other_done = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def wrap(site, fun):
        inside.set()              # thread A is inside its context, tracing through the wrapper
        assert other_done.wait(60)
        return jax.checkpoint(fun, policy=jax.checkpoint_policies.nothing_saveable)

    def a():
        with checkpoint_sites(wrap) as ctx:
            seen["a"] = _count_remat(jax.make_jaxpr(_step(loop_loss))(WS, X))
        seen["a_sites"] = [s.kind for s in ctx.found]

    def b():
        assert inside.wait(60)
        seen["b"] = _count_remat(jax.make_jaxpr(_step(loop_loss))(WS, X))
        seen["b_value"] = jax.jit(_step(loop_loss))(WS, X)
        other_done.set()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert seen["a"] == 1 and seen["a_sites"] == ["grad"]
    assert seen["b"] == 0          # no checkpoint: the other thread called JAX's own value_and_grad
    _close(seen["b_value"], jax.jit(_step(loop_loss))(WS, X))


def _count_remat(closed):
    return str(closed).count("remat")


def inline_loss(ws, x):
    for w in ws:
        h = jnp.sin(x @ w)
        x = x + jnp.tanh(h)
    return jnp.mean(x ** 2)


def test_inline_loop_body_is_a_site_and_the_refactor_it_prints_gives_the_same_program():
    step = _step(inline_loss)
    (loop,) = [s for s in find_sites(step, (WS, X)) if s.kind == "loop"]
    assert loop.call.line == inline_loss.__code__.co_firstlineno + 1 and loop.calls == 4
    assert (loop.callee, loop.args) == ("w", "x")   # the loop variable, the name the body updates
    policy = jax.checkpoint_policies.nothing_saveable

    def layer(x, w):
        h = jnp.sin(x @ w)
        x = x + jnp.tanh(h)
        return x

    def by_hand(ws, x, but_last=False):
        for i, w in enumerate(ws):
            x = layer(x, w) if but_last and i == len(ws) - 1 else jax.checkpoint(layer, policy=policy)(x, w)
        return jnp.mean(x ** 2)

    for but_last in (False, True):
        fitted = with_policy(step, "nothing_saveable", ("loop",), None, but_last)
        assert _remats(fitted) == (3 if but_last else 4)
        hand = _step(partial(by_hand, but_last=but_last))
        assert xla_reference(fitted, (WS, X)).total_bytes == xla_reference(hand, (WS, X)).total_bytes
        _close(jax.jit(step)(WS, X), jax.jit(fitted)(WS, X))


def enumerate_loss(ws, x):
    for i, w in enumerate(ws):
        h = jnp.sin(x @ w) * (i + 1)
        x = x + jnp.tanh(h)
    return jnp.mean(x ** 2)


def test_tuple_loop_target_prints_a_closure_that_gives_the_same_program():
    """`for i, w in enumerate(ws)` has no parameter list to reuse: fit prints the body as a
    function of the updated names alone, defined in the loop and closing over i and w."""
    from jaxmem.fitting.policy import loop_lines

    step = _step(enumerate_loss)
    (loop,) = [s for s in find_sites(step, (WS, X)) if s.kind == "loop"]
    text = loop_lines(loop, "jax.checkpoint_policies.nothing_saveable")
    assert "def layer(x): ..." in text and "x = jax.checkpoint(layer, policy=jax.checkpoint_policies.nothing_saveable)(x)" in text
    policy = jax.checkpoint_policies.nothing_saveable

    def by_hand(ws, x):
        for i, w in enumerate(ws):
            def layer(x):
                h = jnp.sin(x @ w) * (i + 1)
                return x + jnp.tanh(h)
            x = jax.checkpoint(layer, policy=policy)(x)
        return jnp.mean(x ** 2)

    fitted = with_policy(step, "nothing_saveable", ("loop",))
    hand = _step(by_hand)
    assert _remats(fitted) == _remats(hand) == 4
    assert xla_reference(fitted, (WS, X)).total_bytes == xla_reference(hand, (WS, X)).total_bytes
    _close(jax.jit(fitted)(WS, X), jax.jit(hand)(WS, X))


@jax.tree_util.register_pytree_node_class
class _Frozen:
    """A pytree whose flatten reads what `__init__` sets last, as Flax's `FrozenDict`: while its
    `__init__` runs, the half-built `self` is a local of the user's frames."""

    def __init__(self, mapping):
        self._items = dict(mapping)

    def tree_flatten(self):
        return tuple(self._items.values()), tuple(self._items)

    @classmethod
    def tree_unflatten(cls, keys, values):
        return cls(dict(zip(keys, values)))


def test_a_pytree_built_inside_a_layer_does_not_stop_the_site_search():
    def block(h, w):
        params = _Frozen({"w": w})          # built during the trace, inside the layer
        return jnp.tanh(h @ params._items["w"])

    def step(ws, x):
        def loss(ws):
            h = x
            for i in range(ws.shape[0]):
                h = block(h, ws[i])
            return (h ** 2).sum()
        return ws - 0.1 * jax.grad(loss)(ws)

    sites = find_sites(step, (WS, X))
    assert any(s.kind == "layer" and s.function == "block" for s in sites)
    _close(jax.jit(with_policy(step, "nothing_saveable", ("layer",)))(WS, X), jax.jit(step)(WS, X))
