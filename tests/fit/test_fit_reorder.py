"""Issue 12: reordering alone. The function run in jaxmem's planned order computes JAX's own
values, binds the plan's steps in the plan's order, and ties each stored step to the one
before it with a barrier; its figures are XLA's memory_analysis()."""

from __future__ import annotations

import json
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxmem.cli.main import main as cli_main
from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.costs import eqn_cost
from jaxmem.compiler.planner import plan_jaxpr
from jaxmem.fitting.reorder import FOLDED, ordered_function, reorder
from jaxmem.xla.cpu.compile import xla_reference

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


def small_cnn(batch: int = 8, size: int = 32, width: int = 16):
    """Two conv + relu + max-pool layers, a dense head, one SGD step: the max-pool gradient's
    scatter starts from zeros that XLA's CSE merges with the forward relu's `max(x, 0)`."""
    rng = np.random.default_rng(0)

    def w(*shape):
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(np.prod(shape[:-1])))

    params = [w(3, 3, 3, width), w(3, 3, width, 2 * width), w(2 * width * (size // 4) ** 2, 10)]
    x = jnp.asarray(rng.standard_normal((batch, size, size, 3), dtype=np.float32))

    def loss(params, x):
        for k in (0, 1):
            x = lax.conv_general_dilated(x, params[k], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = lax.reduce_window(jnp.maximum(x, 0.0), -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
        return jnp.mean((x.reshape(x.shape[0], -1) @ params[2]) ** 2)

    def step(params, x):
        value, grads = jax.value_and_grad(loss)(params, x)
        return value, [p - 0.1 * g for p, g in zip(params, grads)]

    return step, (params, x)


def _ordered(fn, args, **kw):
    traced = ja.trace(fn, args)
    planned = plan_jaxpr(traced.closed_jaxpr, check=False)
    return planned, ordered_function(planned, traced, **kw)


def test_ordered_function_keeps_values_and_chains_stored_steps_in_plan_order():
    step, args = _step()
    planned, ordered = _ordered(step, args, tie_constants=False)
    for a, b in zip(jax.tree.leaves(jax.jit(step)(*args)), jax.tree.leaves(jax.jit(ordered)(*args))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    jaxpr = jax.make_jaxpr(ordered)(*args).jaxpr
    eqns = jaxpr.eqns
    stored = [s for s in planned.schedule if not s.fused and any(o is not None for o in s.outputs)]
    barriers = [e for e in eqns if e.primitive.name == "optimization_barrier"]
    assert 0 < len(barriers) < len(stored)
    # Both results of each tie are read later: XLA prunes a barrier's unused results, and the tie with them.
    read = {str(v) for e in eqns for v in e.invars} | {str(v) for v in jaxpr.outvars}
    for e in barriers:
        assert len(e.outvars) == 2 and all(str(v) in read for v in e.outvars)
    # The steps appear in the plan's order.
    names = [e.primitive.name for e in eqns if e.primitive.name != "optimization_barrier"]
    assert names == [s.primitive for s in planned.schedule]


@pytest.mark.parametrize("literals", ["alone", "all"])
@pytest.mark.parametrize("make", [_step, small_cnn])
def test_tied_constants_keep_values_bit_for_bit_and_flops(make, literals):
    step, args = make()
    _, ordered = _ordered(step, args, literals=literals)
    for a, b in zip(jax.tree.leaves(jax.jit(step)(*args)), jax.tree.leaves(jax.jit(ordered)(*args)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Zero extra FLOPs: the same equations, plus barriers, which compute nothing.
    assert _flops(ordered, args) == _flops(step, args)


def _flops(fn, args) -> int:
    """FLOPs of fn's equations, barriers left out: XLA runs no kernel for one (it forwards its
    operands' buffers), though the primitive table's default costs it per element."""
    eqns = ja.jaxpr_eqns(jax.make_jaxpr(fn)(*args).jaxpr)
    return sum(eqn_cost(e).flops for e in eqns if e.primitive.name != "optimization_barrier")


def test_every_scalar_constant_is_tied_with_literals_all():
    step, args = small_cnn()
    counts = {}
    for literals in ("alone", "all"):
        _, ordered = _ordered(step, args, literals=literals)
        eqns = jax.make_jaxpr(ordered)(*args).jaxpr.eqns
        counts[literals] = sum(e.primitive.name == "optimization_barrier" for e in eqns)
        if literals == "all":
            # Once the chain has started, only a barrier, or arithmetic XLA folds constants into
            # (FOLDED: left alone, so values stay bit for bit), reads a scalar literal.
            first = next(i for i, e in enumerate(eqns) if e.primitive.name == "optimization_barrier")
            literal_reads = [e for e in eqns[first:] if e.primitive.name not in {"optimization_barrier", *FOLDED}
                             and any(ja.is_literal(v) and np.ndim(ja.literal_value(v)) == 0 for v in e.invars)]
            assert literal_reads == []
    _, chain_only = _ordered(step, args, tie_constants=False)
    plain = sum(e.primitive.name == "optimization_barrier" for e in jax.make_jaxpr(chain_only)(*args).jaxpr.eqns)
    assert plain < counts["alone"] < counts["all"]


def test_reorder_reports_xla_own_totals():
    step, args = _step()
    result = reorder(step, *args, donate_argnums=(0,))
    assert result.xla_total_bytes_before == xla_reference(step, args, donate_argnums=(0,)).total_bytes
    assert result.xla_total_bytes_after == xla_reference(result.fn, args, donate_argnums=(0,)).total_bytes
    assert result.judge == "XLA:CPU"
    assert set(result.candidates) == {"cpu plan order", "constants only"}
    # The lowest candidate is kept, or the original when none is lower.
    assert result.xla_total_bytes_after == min([result.xla_total_bytes_before, *result.candidates.values()])
    assert (result.order == "original") == (result.fn is step)


GPU_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    from test_fit_reorder import _flops, small_cnn
    from jaxmem.fitting.reorder import reorder
    from jaxmem.xla.gpu.compile import compile_for_gpu
    fn, args = small_cnn()
    r = reorder(fn, *args, donate_argnums=(0,), device="h100-80gb")
    def total(f):
        d = compile_for_gpu(f, args, spec="h100_sxm", device="h100-80gb", donate_argnums=(0,), use_cache=False)
        return d["argument_bytes"] + d["output_bytes"] + d["temp_bytes"] - d["alias_bytes"]
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
               zip(jax.tree.leaves(jax.jit(fn)(*args)), jax.tree.leaves(jax.jit(r.fn)(*args))))
    flops = [_flops(f, args) for f in (fn, r.fn)]
    print(json.dumps({{"before": r.xla_total_bytes_before, "after": r.xla_total_bytes_after,
                      "xla_before": total(fn), "xla_after": total(r.fn), "plan": r.planned_peak_bytes,
                      "order": r.order, "same": same, "flops": flops}}))
""")


@pytest.mark.slow
def test_order_lowers_xla_gpu_memory_analysis_on_a_small_cnn(run_gpu_script):
    data = run_gpu_script(GPU_SCRIPT)
    # The figures are XLA:GPU's own memory_analysis(), compiled afresh.
    assert (data["before"], data["after"]) == (data["xla_before"], data["xla_after"])
    assert data["plan"] < data["after"] < data["before"] and data["order"] != "original"
    assert data["same"] and data["flops"][0] == data["flops"][1]


def test_optimize_cli_json_and_one_line_errors(capsys):
    assert cli_main(["optimize", TARGET, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["values_unchanged"] is True and data["extra_flops"] == 0
    assert data["xla_total_bytes_before"] > 0 and data["xla_total_bytes_after"] > 0
    assert cli_main(["optimize", TARGET, "--device", "h900"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown device" in err[0]
