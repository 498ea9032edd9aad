"""jaxmem's GPU-target plan with GEMM epilogues (`fusion.gemm_epilogues`): a GEMM result only a
sum reads is added inside the GEMM and never stored, as XLA:GPU's Triton GEMM fusions do with a
scan's accumulated weight gradient (`acc + x.T @ dy`, written over `acc`). Checked against
XLA:GPU's own total, the checker, and the values JAX computes."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxmem.compiler.checker import check_plan
from jaxmem.compiler.planner import plan, plan_jaxpr
from jaxmem.execution.verify import compare_with_jit
from jaxmem.xla.gpu.compile import xla_gpu_reference
from jaxmem.xla.gpu.model.predict import gpu_plan_fusion, plan_on_gpu

from gpu_test_support import needs_gpu_compiler


def accumulate_scan():
    """A weight gradient accumulated over 16 steps of a scan: acc += x_t.T @ dy_t (2 MiB)."""
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((16, 64, 512), dtype=np.float32))
    dys = jnp.asarray(rng.standard_normal((16, 64, 1024), dtype=np.float32))

    def accumulate(acc, xs, dys):
        def step(acc, xy):
            x, dy = xy
            return acc + x.T @ dy, None
        return jax.lax.scan(step, acc, (xs, dys))[0]

    return accumulate, (jnp.zeros((512, 1024), jnp.float32), xs, dys)


def test_epilogue_sum_is_not_written_over_the_gemm_operands():
    # tanh(x).T has as many elements as the sum and dies there: an elementwise op could reuse
    # its buffer, a GEMM's epilogue (which reads it while it writes) must not
    def f(acc, x, y):
        return acc + jnp.tanh(x).T @ y
    args = (jnp.ones((256, 256)), jnp.ones((256, 256)) * 0.5, jnp.ones((256, 256)))
    gpu = plan_jaxpr(jax.make_jaxpr(f)(*args), base_fusion=gpu_plan_fusion)
    assert gpu.valid
    by_primitive = {s.primitive: s for s in gpu.schedule}
    assert by_primitive["dot_general"].fused            # computed inside the sum
    out_buffer = gpu.values[by_primitive["add"].outputs[0]].buffer
    operand_buffers = {gpu.values[v].buffer for name in ("tanh", "transpose") for v in by_primitive[name].outputs}
    assert out_buffer is not None and out_buffer not in operand_buffers
    assert compare_with_jit(f, args, gpu)["ok"]


def test_checker_rejects_an_epilogue_written_over_a_gemm_operand():
    def f(acc, x, y):
        return acc + jnp.tanh(x).T @ y
    args = (jnp.ones((256, 256)), jnp.ones((256, 256)) * 0.5, jnp.ones((256, 256)))
    gpu = plan_jaxpr(jax.make_jaxpr(f)(*args), base_fusion=gpu_plan_fusion)
    steps = {s.primitive: s for s in gpu.schedule}
    operand = gpu.values[steps["transpose"].outputs[0]]
    add_out = steps["add"].outputs[0]
    # move the sum into the transposed operand's buffer, which dies at the sum: what an
    # elementwise op may do, and a GEMM's epilogue may not
    values = dict(gpu.values)
    values[add_out] = dataclasses.replace(values[add_out], buffer=operand.buffer)
    buffers = list(gpu.buffers)
    old = gpu.values[add_out].buffer
    buffers[operand.buffer] = dataclasses.replace(buffers[operand.buffer], end=buffers[old].end,
                                                  values=buffers[operand.buffer].values + [add_out])
    buffers[old] = dataclasses.replace(buffers[old], values=[v for v in buffers[old].values if v != add_out])
    problems = check_plan(dataclasses.replace(gpu, values=values, buffers=buffers))
    assert any("computed inside it reads" in p for p in problems)


@needs_gpu_compiler
def test_scan_accumulator_plan_at_or_below_xla_gpu():
    fn, args = accumulate_scan()
    cpu = plan(fn, *args, xla=False)
    gpu = plan_on_gpu(cpu)
    assert gpu.valid and gpu.scheduler.endswith("+gpu-fusion")
    # the step's [512, 1024] GEMM result is never stored: no scratch of its size in the loop
    scan_step = next(s for s in gpu.schedule if s.primitive == "scan")
    assert scan_step.scratch_bytes < 512 * 1024 * 4
    ref = xla_gpu_reference(f"{__file__}:accumulate_scan", device="h100-80gb", top=0)
    assert gpu.peak_bytes <= ref.total_bytes < cpu.peak_bytes   # the CPU-model plan holds it
    assert compare_with_jit(fn, args, gpu)["ok"]
