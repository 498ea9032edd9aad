"""The XLA:GPU model's convolution passes (`xla.gpu.model.conv`): which cuDNN call each jaxpr
convolution becomes (conv_rewriter.cc), whose operands are swapped (conv_operand_swapper.cc),
which inputs are padded (conv_padding_legalization.cc) or copied to cuDNN's layout
(layout_assignment.cc), checked on the small programs of `fusion_programs.py` and against
XLA:GPU's deviceless compile."""

from __future__ import annotations

import jax
import pytest

from jaxmem.compiler import planner
from jaxmem.compiler.fusion import forced_fusion
from jaxmem.xla.gpu.model import conv as gc
from jaxmem.xla.gpu.model import fusion as gf

from gpu_test_support import load_fusion_program, needs_gpu_compiler, predicted_and_xla

H100, A100 = "h100-80gb", "a100-40gb"


def _program(name):
    _, factory = load_fusion_program(name)
    fn, args = factory()
    return planner.inlined(jax.make_jaxpr(fn)(*args))


def _calls(g, device=H100):
    """Per jaxpr convolution: (cuDNN kind, operands swapped, padded elements, stored copies' bytes)."""
    plan = gc.conv_plan(g, device)
    out = []
    for op in g.ops:
        if op.primitive == "conv_general_dilated":
            c = gc.conv_of(g, op)
            s = gc.swapped(c)
            kind, _, padded = gc.cudnn_roles(s)
            out.append((kind, s is not c, padded, gc.conv_operand_scratch(g, op, plan)))
    return out


def test_a_strided_convolution_gradient_is_three_cudnn_calls_with_nothing_stored_on_h100():
    assert _calls(_program("strided_conv_grad")) == [("forward", False, 0, 0), ("backward_filter", False, 0, 0),
                                                     ("backward_input", False, 0, 0)]


def test_nchw_on_a100_copies_the_input_and_the_returned_gradient():
    g = _program("strided_conv_grad")
    calls = _calls(g, A100)
    x_bytes = 32 * 64 * 64 * 32 * 4
    assert calls[2][3] == x_bytes          # the input's gradient, copied back to NHWC
    # the input's NCHW copy is read by the forward and the backward-filter calls: one copy
    # (CSE), held from the first to the last, so neither call's own scratch
    convs = [op.index for op in g.ops if op.primitive == "conv_general_dilated"]
    x = g.invars[1]
    assert gc.conv_plan(g, A100).shared_copies == {x: (x_bytes, [convs[0], convs[1]])}
    assert calls[0][3] == calls[1][3] == 0
    assert gc.conv_plan(g, H100).shared_copies == {}     # NHWC: nothing to copy


def test_a_shared_copy_lives_from_its_first_reader_to_its_last():
    g = _program("conv_batchnorm_grad")
    convs = [op.index for op in g.ops if op.primitive == "conv_general_dilated"]
    order = list(range(len(g.ops)))
    x_bytes = 64 * 32 * 32 * 16 * 4
    (span,) = gc.shared_copy_spans(g, order, A100)
    assert span[2] == x_bytes and span[0] == convs[0]
    bw_filter = [c for c in convs if gc.cudnn_roles(gc.swapped(gc.conv_of(g, g.ops[c])))[0] == "backward_filter"]
    assert span[1] == max(bw_filter)       # the first convolution's weight gradient reads x last
    assert gc.shared_copy_spans(g, order, H100) == []


def test_a_transposed_convolution_pads_its_input_and_swaps_its_weight_gradient():
    (fwd, wgrad, xgrad) = _calls(_program("transposed_conv_grad"))
    assert fwd[:3] == ("forward", False, 32 * 35 * 35 * 64)          # (16 - 1) * 2 + 1 + 2 + 2
    assert wgrad[:2] == ("forward", True)                             # kernel 32x32 > input 16x16
    assert wgrad[3] == 32 * 32 * 32 * 32 * 4 + 32 * 16 * 16 * 64 * 4  # both operands transposed
    assert xgrad == ("forward", False, 0, 0)                          # a strided convolution


def test_conv_operands_materialized_fuses_the_activation_into_the_pad_and_transpose():
    g = _program("transposed_conv_of_activation")
    roles = planner.value_roles(g, [False] * len(g.invars), (), ())
    fused = forced_fusion(g, roles)
    ctx = gf.fusion_context(g, roles, device=H100, store_shared_casts=True, output_epilogues=True,
                            store_reread_producers=False, fused=fused)
    act = next(op.outputs[0] for op in ctx.g.ops if op.primitive == "select_n")
    assert gc.conv_operands_materialized(ctx, [False] * ctx.g.num_values) == {act: True}
    assert gc.conv_operands_materialized(gf.fusion_context(g, roles, device=None, store_shared_casts=True,
                                                           output_epilogues=True, store_reread_producers=False,
                                                           fused=fused), [False] * ctx.g.num_values) == {}
    assert gc.conv_operands_materialized in gf.FUSION_RULES


def _side_input_fusion(name, device=H100):
    g = _program(name)
    roles = planner.value_roles(g, [False] * len(g.invars), (), ())
    fused = forced_fusion(g, roles)
    ctx = gf.fusion_context(g, roles, device=device, store_shared_casts=True, output_epilogues=True,
                            store_reread_producers=False, fused=fused)
    return ctx, gf.run_fusion_rules(ctx, fused), roles


def test_a_forward_convolution_adds_its_bias_and_side_input_inside_its_call():
    ctx, fused, roles = _side_input_fusion("conv_side_input")
    g = ctx.g
    convs = [op for op in g.ops if op.primitive == "conv_general_dilated"]
    third = convs[2].outputs[0]
    bias_sum = g.ops[g.users[third][0]].outputs[0]
    call = g.ops[g.users[bias_sum][0]]
    side = next(u for u in call.operands if u != bias_sum)
    assert g.ops[g.producer[side]].primitive == "mul"
    assert fused[third] and fused[bias_sum]                         # never stored: the call writes the sum
    assert not fused[call.outputs[0]] and not fused[side]           # the sum and its side input are stored
    assert not any(fused[op.outputs[0]] for op in convs[:2])        # p, q: read by the multiply and the loss
    assert gc.conv_calls(g, roles, fused) == {convs[2].index: call.index}
    assert gc.conv_side_inputs in gf.FUSION_RULES
    assert gc.conv_side_inputs(gf.fusion_context(g, roles, device=None, store_shared_casts=True,
                                                 output_epilogues=True, store_reread_producers=False,
                                                 fused=forced_fusion(g, roles)), list(fused)) == {}


def test_a_1x1_kernel_reversed_for_the_input_gradient_is_a_forward_call_taking_a_side_input():
    ctx, fused, _ = _side_input_fusion("conv1x1_input_gradient")
    g = ctx.g
    kinds = [gc.cudnn_roles(gc.swapped(gc.conv_of(g, op)))[0] for op in g.ops if op.primitive == "conv_general_dilated"]
    assert kinds == ["forward", "forward"]    # algebraic_simplifier.cc drops the reverse of a 1x1 kernel
    grad = next(op for op in g.ops if op.primitive == "conv_general_dilated" and gc.conv_of(g, op).lhs not in g.invars)
    assert fused[grad.outputs[0]]


# transposed_conv_grad and transposed_conv_of_activation on H100: 1.017 since the tanh
# gradient no longer overwrites the conv's result (`xla.gpu.model.heap.conv_results_kept`; the
# dump's `cudnn-conv.5{0}` and `input_add_transpose_fusion{0}` are at offsets of their own):
# the backward-filter call's transposed copies (one 6 MiB scratch in the model, XLA's
# `input_transpose_fusion` and `loop_transpose_fusion` apart) leave 0.3 MiB of fragmentation
@needs_gpu_compiler
@pytest.mark.parametrize("name,device,tolerance", [
    ("strided_conv_grad", H100, 0.01), ("strided_conv_grad", A100, 0.01),
    ("transposed_conv_grad", H100, 0.02), ("transposed_conv_of_activation", H100, 0.02),
    ("transposed_conv_of_activation", A100, 0.05),
    ("conv_side_input", H100, 0.01), ("conv_side_input", A100, 0.01), ("conv_side_input_nchw", H100, 0.01),
    ("conv_side_input_nchw", A100, 0.01),
    ("conv1x1_input_gradient", H100, 0.01), ("conv1x1_input_gradient", A100, 0.01)])
def test_convolution_programs_against_xla(name, device, tolerance):
    pred, ref, _ = predicted_and_xla(name, device)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= tolerance
