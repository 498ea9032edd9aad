"""`fit(...).fn` works like the original under `jax.jit`: a state rebuilt by the same factory
(new closures in its static fields) is accepted, a real mismatch is one line naming the argument;
and fit times a step before and after, beside the FLOPs."""

from __future__ import annotations

import json
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxmem
from jaxmem.cli.main import main as cli_main
from jaxmem.errors import PlanError

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "user_models.py")


class Block(eqx.Module):
    linear: eqx.nn.Linear
    act: object = eqx.field(static=True)

    def __call__(self, x):
        return self.act(jax.vmap(self.linear)(x))


def make_step(seed=0, batch=2048, width=512, depth=4):
    """An Equinox step whose model holds a closure made anew on every call (its static field)."""
    scale = 0.5 + seed * 0.0          # a closure over a local, as configs make them
    act = lambda x: jnp.tanh(scale * x)  # noqa: E731
    keys = jax.random.split(jax.random.key(seed), depth + 1)
    model = [Block(eqx.nn.Linear(width, width, key=k), act) for k in keys[:depth]]
    params, static = eqx.partition(model, eqx.is_array)
    tx = optax.sgd(1e-2)
    x = jax.random.normal(keys[-1], (batch, width))

    def step(params, opt_state, x):
        def loss_fn(p):
            h = x
            for block in eqx.combine(p, static):
                h = block(h)
            return jnp.mean(h ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    return step, (model, tx.init(params), x), params


def _args(seed=0):
    step, (model, opt_state, x), params = make_step(seed)
    return step, (params, opt_state, x)


@pytest.fixture(scope="module")
def fitted():
    step, args = _args()
    budget = int(0.7 * jaxmem.plan(step, *args).xla.total_bytes)
    return jaxmem.fit(step, *args, budget=budget, max_rounds=3)


def test_the_fitted_function_accepts_a_rebuilt_state(fitted):
    step, args = _args()                       # the same factory again: new closures, new arrays
    assert fitted.fn is not fitted.original_fn
    got = jax.jit(fitted.fn)(*args)
    want = jax.jit(step)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-5)


def test_a_real_mismatch_is_one_line_naming_the_argument(fitted):
    step, (params, opt_state, x) = _args()
    with pytest.raises(PlanError) as err:
        fitted.fn(params, opt_state, x[:100])
    text = str(err.value)
    assert "\n" not in text and len(text) < 300
    assert text.startswith("argument args[2] is float32[100, 512] where fit traced float32[2048, 512]")
    with pytest.raises(PlanError) as err:
        fitted.fn(params[:2], opt_state, x)     # two blocks where fit traced four
    assert "\n" not in str(err.value) and "args[0]" in str(err.value) and len(str(err.value)) < 300


@pytest.mark.slow  # tens of seconds of XLA compiles; in the slow pass
def test_fit_times_a_step_before_and_after(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert cli_main(["fit", f"{HERE}:flax_linen_step", "--budget", "90%", "--rounds", "2", "--json",
                     "--no-schedulers"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert data["step_seconds_before"] > 0 and data["step_seconds_after"] > 0
    assert cli_main(["fit", f"{HERE}:flax_linen_step", "--budget", "90%", "--rounds", "2", "--no-schedulers"]) in (0, 1)
    assert "step time (jax.jit here, warm)" in capsys.readouterr().out
