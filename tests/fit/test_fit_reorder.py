"""Issue 12: reordering alone. The function run in jaxmem's planned order computes JAX's own
values, binds the plan's steps in the plan's order, and ties each stored step to the one
before it with a barrier; its figures are XLA's memory_analysis()."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.cli.main import main as cli_main
from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.planner import plan_jaxpr
from jaxmem.fitting.reorder import ordered_function, reorder
from jaxmem.xla.cpu import xla_reference

TARGET = "jaxmem.examples.suite:mlp_train"


def _step():
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((64, 64), dtype=np.float32) / 8) for _ in range(4)]
    x = jnp.asarray(rng.standard_normal((256, 64), dtype=np.float32))

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    def step(ws, x):
        value, grads = jax.value_and_grad(loss)(ws, x)
        return value, [w - 0.1 * g for w, g in zip(ws, grads)]

    return step, (ws, x)


def test_ordered_function_keeps_values_and_chains_stored_steps_in_plan_order():
    step, args = _step()
    traced = ja.trace(step, args)
    planned = plan_jaxpr(traced.closed_jaxpr, check=False)
    ordered = ordered_function(planned, traced)
    for a, b in zip(jax.tree.leaves(jax.jit(step)(*args)), jax.tree.leaves(jax.jit(ordered)(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    eqns = jax.make_jaxpr(ordered)(*args).jaxpr.eqns
    stored = [s for s in planned.schedule if not s.fused and any(o is not None for o in s.outputs)]
    barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) == len([s for s in stored[1:] if s.inputs])
    # The steps appear in the plan's order.
    names = [e.primitive.name for e in eqns if e.primitive.name != "optimization_barrier"]
    assert names == [s.primitive for s in planned.schedule]


def test_reorder_reports_xla_own_totals():
    step, args = _step()
    result = reorder(step, *args, donate_argnums=(0,))
    assert result.xla_total_bytes_before == xla_reference(step, args, donate_argnums=(0,)).total_bytes
    assert result.xla_total_bytes_after == xla_reference(result.fn, args, donate_argnums=(0,)).total_bytes
    assert result.judge == "XLA:CPU" and result.chained_steps > 0


def test_optimize_cli_json_and_one_line_errors(capsys):
    assert cli_main(["optimize", TARGET, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["values_unchanged"] is True and data["extra_flops"] == 0
    assert data["xla_total_bytes_before"] > 0 and data["xla_total_bytes_after"] > 0
    assert cli_main(["optimize", TARGET, "--device", "h900"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown device" in err[0]
