"""Three XLA:GPU behaviours of convolutional U-Nets (`gpu_model_heap`), each on its own program
of `fusion_programs.py`: a folded max-pool gradient has no zeros to share with a relu
(`shared_zero_spans`), a cuDNN call's result is never overwritten in place
(`conv_results_kept`), and a pool gradient's index arrays live from where XLA's list scheduler
runs their reduce-window (`pool_index_spans`). The rules' own output first, then the
prediction against XLA:GPU's deviceless compile; last, a known gap (a group norm step)."""

from __future__ import annotations

import pytest

from jaxmem.compiler.stages import live_profile
from jaxmem.xla import gpu_model_heap as gh

from gpu_test_support import heap_cases, needs_gpu_compiler, predicted_and_xla

H100, A100 = "h100-80gb", "a100-40gb"


def _cases(name, device=H100):
    """Per scheduler of the model, (the HeapCase, the intervals after the interval adjustments)
    for the fusion program `name`."""
    def look(case):
        intervals = case.live.intervals
        for adjust in gh.INTERVAL_ADJUSTMENTS:
            intervals = adjust(case, intervals)
        return case, intervals
    return heap_cases(name, look, device)


def test_a_folded_pool_gradient_shares_no_zeros_with_the_relu():
    for case, _ in _cases("relu_max_pool_gradient_added").values():
        assert gh.shared_zero_spans(case) == []
    # a pool gradient nothing adds to still writes into the relu's shared zeros
    assert all(len(gh.shared_zero_spans(case)) == 2 for case, _ in _cases("relu_max_pool_gradient").values())


def test_a_convolution_result_is_not_overwritten_by_the_batch_norm_gradient():
    for case, intervals in _cases("conv_batchnorm_grad").values():
        g = case.g
        for iv in intervals:
            prims = [g.ops[g.producer[v]].primitive for v in iv.members if g.producer[v] >= 0]
            if prims and prims[0] == "conv_general_dilated":
                assert prims == ["conv_general_dilated"], prims
    # without the rule the model writes the gradient over the conv result
    case, _ = _cases("conv_batchnorm_grad")["list"]
    g = case.g
    shared = [iv for iv in case.live.intervals if len(iv.members) > 1
              and g.ops[g.producer[iv.members[0]]].primitive == "conv_general_dilated"]
    assert shared


def test_pool_indices_live_from_the_forward_decoder_in_the_list_order():
    seen = _cases("pool_indices_in_decoder")
    case, _ = seen["list"]
    g = case.g
    spans = gh.pool_index_spans(case)
    scatter = next(op for op in g.ops if op.primitive == "select_and_scatter_add")
    pooled = 64 * 16 * 16 * 32 * 4
    at = spans[0][0]
    # four s32 arrays of the pooled shape to the scatter, the pooled values dead at once
    assert sorted(spans) == sorted([(at, case.order.index(scatter.index), pooled)] * 4 + [(at, at, pooled)])
    start, end = at, case.order.index(scatter.index)
    heap = gh.case_heap(case)
    peak = int(live_profile(heap, len(case.order)).argmax()) - 1
    assert start < peak < end                          # held through the backward's peak
    # the DFS order visits the reduce-window right before the scatter
    dfs = seen["dfs"][0]
    assert {s[0] for s in gh.pool_index_spans(dfs)} == {dfs.order.index(scatter.index)}


@pytest.mark.slow
@needs_gpu_compiler
@pytest.mark.parametrize("device", [H100, A100])
def test_unet_rules_against_xla(device):
    # the folded pool gradient: 1.22 of XLA's total with the shared zeros (before the rule);
    # what is left is the jnp.repeat gradient's two size-2 reductions, which XLA emits
    # elementally inside one loop fusion (`loop_select_fusion.1`) and the model stores
    pred, ref, _ = predicted_and_xla("relu_max_pool_gradient_added", device)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.08
    # the batch norm's gradient beside the conv result: 0.79 of XLA's total on H100 without the
    # rule; on A100 0.875 without the input's one NCHW copy held from the forward call to the
    # backward-filter call (`gpu_model_conv.shared_copy_spans`; the dump's `wrapped_transpose.1`)
    pred, ref, _ = predicted_and_xla("conv_batchnorm_grad", device)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.02
    # the index arrays through the backward's peak: 0.83 (H100) / 0.81 (A100) without the
    # rule; what is left is the transposed convolution's gradient (its transposed copies)
    pred, ref, _ = predicted_and_xla("pool_indices_in_decoder", device)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.11


# A known gap, kept as a target: the model's `softmax_outputs` takes any reduce over the last
# dimension for a Triton softmax diamond, so it stores the group norm's diamond roots, which
# XLA:GPU computes in their readers (it makes no Triton softmax fusion here). With
# ShouldFuseReduction's condition the model is 0.997 / 0.927 of XLA's total, but the same change
# takes the tuning model unet out of the band on A100 (BENCHMARKS.md, "diffusion_denoiser, a
# closer look"), so it is not merged. Strict: it fails once the model is within 5%.
@pytest.mark.slow
@needs_gpu_compiler
@pytest.mark.xfail(strict=True, reason="group norm taken for a Triton softmax diamond: 1.303 (H100), 1.211 (A100)")
@pytest.mark.parametrize("device", [H100, A100])
def test_a_group_norm_step_against_xla(device):
    pred, ref, _ = predicted_and_xla("group_norm_silu_conv", device)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.05
