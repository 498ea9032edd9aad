"""Four XLA:GPU behaviours of the GPU model, checked against XLA:GPU's deviceless compiles on
both devices:

- GEMM epilogues (`xla.gpu.model.fusion_gemm.output_epilogues`): an elementwise chain that alone reads a
  GEMM's result is computed in the GEMM fusion, which writes the chain's last value; an SGD
  update into a donated weight stores no gradient.
- split-K partials read by a GEMM's prologue through fused steps (`xla.gpu.model.splitk.FUSED_GEMM_READER_DEPTH`):
  the prologue's last value is stored and the partials die there.
- a donated buffer updated in place by a chain of `dynamic_update_slice`
  (`xla.gpu.model.heap.donated_output_prefix_spans`): every update is written in the argument's allocation.
- GEMM prologues (`xla.gpu.model.fusion_producers.gemm_prologue_not_worth_fusing`): an elementwise op that reads more
  bytes than it writes (a masked select) is stored for the GEMM, not computed in its operand.
"""

from __future__ import annotations

import pytest

from jaxmem.xla.gpu.model import predict as gpu_model
from jaxmem.xla.gpu.compile import xla_gpu_reference

from gpu_test_support import FUSION, load_fusion_program, needs_gpu_compiler, predicted_and_xla

DEVICES = ["h100-80gb", "a100-40gb"]
# (program, donated arguments)
PROGRAMS = [("gemm_epilogue_into_donated", (0,)), ("splitk_partials_die_at_prologue", ()),
            ("dus_chain_into_donated", (0,))]


@pytest.fixture
def fresh_predictions():
    gpu_model._device_temps_kept.clear()
    yield
    gpu_model._device_temps_kept.clear()


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,donate", PROGRAMS)
def test_rule_predicts_xla_temp(name, donate, device, fresh_predictions):
    pred, ref, module = predicted_and_xla(name, device, donate)
    # XLA itself stores none of the large values these rules are about
    assert ref.temp_bytes < module.BIG // 16
    assert abs(pred.temp_bytes - ref.temp_bytes) <= 64 * 1024, (pred.temp_bytes, ref.temp_bytes)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.01


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
def test_no_epilogue_when_the_gemm_result_has_a_second_reader(device, fresh_predictions):
    # the gradient is also returned: the rule must leave the prediction where XLA is
    pred, ref, _ = predicted_and_xla("gemm_result_also_returned", device, (0,))
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.01, (pred.total_bytes, ref.total_bytes)


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["masked_select_into_gemm", "relu_into_gemm"])
def test_gemm_prologue_stored_where_xla_stores_it(name, device, fresh_predictions):
    # the select is stored (16 MiB), relu(x) * 2 stays in the GEMM's operand (XLA's own figures)
    pred, ref, module = predicted_and_xla(name, device)
    stored = name == "masked_select_into_gemm"
    assert (ref.temp_bytes >= module.BIG) == stored
    assert (pred.temp_bytes >= module.BIG) == stored, (pred.temp_bytes, ref.temp_bytes)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.01


@needs_gpu_compiler
def test_own_gpu_plan_writes_the_sgd_update_from_the_gemm():
    """jaxmem's own GPU plan takes XLA's GEMM output epilogues where an update chain ends in an
    output (`xla.gpu.model.predict.gpu_plan_output_epilogues`): without them it held each weight gradient
    beside the weights, above XLA:GPU's own total; with them it is at or below it, checked,
    and runs on the host to jax.jit's values."""
    import jaxmem
    from jaxmem.execution.verify import compare_with_jit

    name = "sgd_ensemble"
    _, factory = load_fusion_program(name)
    ref = xla_gpu_reference(f"{FUSION}:{name}", device="h100-80gb", donate_argnums=(0,), top=0)
    fn, args = factory()
    plan = gpu_model.plan_on_gpu(jaxmem.plan(fn, *args, donate_argnums=(0,), xla=False))
    assert plan.valid and plan.peak_bytes <= ref.total_bytes, (plan.peak_bytes, ref.total_bytes)
    assert compare_with_jit(fn, args, plan)["ok"]
