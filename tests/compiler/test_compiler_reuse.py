"""One jaxpr planned for two targets and modelled for XLA:GPU is inlined once (`planner.inlined`),
and the side tables shared between plans (`program.side_table`) never change a result: plans made
again, after other plans of the same program, are the plans made first."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmem.compiler import planner
from jaxmem.compiler.planner import plan_jaxpr
from jaxmem.xla.gpu.model.predict import gpu_plan_fusion, predict


def _step(w, x):
    h = jnp.tanh(x @ w)
    return w - 0.1 * jax.grad(lambda w: (jnp.tanh(x @ w) * h).sum())(w), h.T @ h


def _figures(p):
    return (p.peak_bytes, p.lower_bound_bytes, p.scheduler, p.placement, p.valid,
            [(s.primitive, s.fused) for s in p.schedule], [(b.offset, b.size, b.start, b.end) for b in p.buffers])


def test_one_program_for_both_plans_and_the_prediction_and_the_same_results():
    jaxpr = jax.make_jaxpr(_step)(jnp.ones((256, 256)), jnp.ones((64, 256)))
    program = planner.inlined(jaxpr)
    first_cpu = plan_jaxpr(jaxpr, donated=[True, False])
    first_gpu = plan_jaxpr(jaxpr, donated=[True, False], base_fusion=gpu_plan_fusion)
    first_pred = predict(jaxpr, donated=[True, False])
    assert planner.inlined(jaxpr) is program
    planner._inlined.clear()   # fresh programs and side tables: the same plans
    assert _figures(plan_jaxpr(jaxpr, donated=[True, False], base_fusion=gpu_plan_fusion)) == _figures(first_gpu)
    assert _figures(plan_jaxpr(jaxpr, donated=[True, False])) == _figures(first_cpu)
    assert predict(jaxpr, donated=[True, False]).total_bytes == first_pred.total_bytes
    assert first_cpu.valid and first_gpu.valid
