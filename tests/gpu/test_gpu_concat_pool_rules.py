"""Two rules of the XLA:GPU model on the programs of `fusion_programs.py` that show them: a
concatenate cloned into the GEMMs that read it (`gpu_model_fusion_concat.cloned_gemm_concats`,
a `FUSION_RULES` entry) and a max-pool gradient's zeros that XLA's list scheduler runs first
(`gpu_model_heap.early_scatter_zero_spans`, a `SPAN_ADJUSTMENTS` entry): each rule's own
decision, then the prediction against XLA:GPU's deviceless compile."""

from __future__ import annotations

import jax
import pytest

from jaxmem.compiler import planner
from jaxmem.compiler.fusion import forced_fusion
from jaxmem.xla import gpu_model_fusion as gf
from jaxmem.xla import gpu_model_heap as gh
from jaxmem.xla.gpu_model import predict
from jaxmem.xla.gpu_model_fusion_concat import cloned_gemm_concats, concat_copy_scratch

from gpu_test_support import load_fusion_program, needs_gpu_compiler, predicted_and_xla

H100, A100 = "h100-80gb", "a100-40gb"


def _concat_changes(name):
    """(program, the rule's changes) for the fusion program `name` on H100."""
    _, factory = load_fusion_program(name)
    fn, args = factory()
    g = planner.inlined(jax.make_jaxpr(fn)(*args))
    roles = planner.value_roles(g, [False] * len(g.invars), (), ())
    forced = forced_fusion(g, roles)
    ctx = gf.fusion_context(g, roles, device=H100, store_shared_casts=True, output_epilogues=True,
                            store_reread_producers=False, fused=forced)
    fused = list(forced)
    for v, flag in gf.fuse_cheap_producers(ctx, fused).items():
        fused[v] = flag
    return ctx.g, cloned_gemm_concats(ctx, fused)


def _outputs_of(g, changes, primitive):
    return [changes.get(op.outputs[0]) for op in g.ops if op.primitive == primitive]


def test_cloned_gemm_concats_is_registered_after_the_producer_pass():
    assert gf.FUSION_RULES.index(cloned_gemm_concats) == gf.FUSION_RULES.index(gf.fuse_cheap_producers) + 1
    assert cloned_gemm_concats.__doc__ and "gemm_fusion.cc" in cloned_gemm_concats.__doc__


def test_cloned_gemm_concats_fuses_a_concatenation_the_weight_gradient_reads():
    """128-wide pieces: the concatenation is fused, its tanh piece stored (no producer is
    fused into a concatenate inside a GEMM); 96-wide pieces: no GEMM takes it."""
    g, changes = _concat_changes("concat_read_by_weight_gradient")
    assert _outputs_of(g, changes, "concatenate") == [True]
    assert _outputs_of(g, changes, "tanh") == [False]
    assert _outputs_of(g, changes, "gather") == [None]
    g, changes = _concat_changes("concat_not_tiled_by_gemm")
    assert changes == {}
    g, changes = _concat_changes("concat_read_by_padded_split_gemm")
    assert changes == {}


def test_concat_copy_scratch_at_the_gemm_that_contracts_the_concatenation():
    """The forward GEMM of a cloned concatenation reads a copy made right before it; the
    weight gradient's GEMM and a concatenation no GEMM clones add nothing."""
    for name, copies in (("concat_read_by_weight_gradient", [384 * 8192 * 4, 0]),
                         ("concat_not_tiled_by_gemm", [0, 0])):
        _, factory = load_fusion_program(name)
        fn, args = factory()
        g = planner.inlined(jax.make_jaxpr(fn)(*args))
        concat = next(op for op in g.ops if op.primitive == "concatenate").outputs[0]
        readers = [g.ops[c] for c in g.users[concat]]
        assert [concat_copy_scratch(g, op, H100) for op in readers] == copies


def test_cloned_gemm_concats_leaves_a_concatenation_only_contracted():
    """A concatenation along the contracting dimension of its only GEMM (inference) stays
    stored: GEMM fusion takes a concatenate only along the operand's non-contracting one."""
    def fn(a, b, w):
        return jax.numpy.concatenate([a, b], -1) @ w
    f32 = jax.numpy.float32
    g = planner.inlined(jax.make_jaxpr(fn)(jax.numpy.ones((512, 128), f32), jax.numpy.ones((512, 128), f32),
                                           jax.numpy.ones((256, 64), f32)))
    roles = planner.value_roles(g, [False] * len(g.invars), (), ())
    forced = forced_fusion(g, roles)
    ctx = gf.fusion_context(g, roles, device=H100, store_shared_casts=True, output_epilogues=True,
                            store_reread_producers=False, fused=forced)
    assert cloned_gemm_concats(ctx, list(forced)) == {}


@pytest.mark.slow
@needs_gpu_compiler
@pytest.mark.parametrize("name", ["concat_read_by_weight_gradient", "concat_not_tiled_by_gemm"])
def test_cloned_gemm_concats_matches_xla(name):
    """H100 exactly; on A100 the model holds one f32[8192, 128] fewer at the peak, by a
    difference (not the concatenation) the rule does not model."""
    pred, ref, _ = predicted_and_xla(name, H100)
    assert pred.temp_bytes == ref.temp_bytes
    pred, ref, _ = predicted_and_xla(name, A100)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.08


def _zero_spans(name):
    """Per scheduler of the model, the spans `early_scatter_zero_spans` adds for `name`."""
    _, factory = load_fusion_program(name)
    fn, args = factory()
    g = planner.inlined(jax.make_jaxpr(fn)(*args))
    seen = {}
    original = gh.case_heap

    def spy(case):
        seen[case.scheduler] = gh.early_scatter_zero_spans(case)
        return original(case)
    gh.case_heap = spy
    try:
        predict(jax.make_jaxpr(fn)(*args), device=H100)
    finally:
        gh.case_heap = original
    return g, seen


def test_early_scatter_zero_spans_hold_lone_pool_gradients_zeros_in_the_list_order():
    g, seen = _zero_spans("max_pool_gradient_not_added")
    assert gh.early_scatter_zero_spans in gh.SPAN_ADJUSTMENTS
    sizes = sorted(s[2] for s in seen["list"])
    assert sizes == sorted(g.nbytes[op.outputs[0]] for op in g.ops if op.primitive == "select_and_scatter_add")
    assert all(s[0] == 0 for s in seen["list"])
    assert seen["dfs"] == []


@pytest.mark.parametrize("name", ["max_pool_gradient_added", "relu_max_pool_gradient"])
def test_early_scatter_zero_spans_skip_added_and_shared_zeros(name):
    """Added to another gradient (folded into the scatter's operand) or shared with a relu's
    zeros (`shared_zero_spans`): no span."""
    _, seen = _zero_spans(name)
    assert seen["list"] == [] and seen["dfs"] == []


@pytest.mark.slow
@needs_gpu_compiler
@pytest.mark.parametrize("device", [H100, A100])
def test_early_scatter_zero_spans_match_xla(device):
    pred, ref, _ = predicted_and_xla("max_pool_gradient_not_added", device)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.02
    pred, ref, _ = predicted_and_xla("max_pool_gradient_added", device)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.06

