"""The concatenate rules of the XLA:GPU model on the programs of `fusion_programs.py` that show
them: a concatenate cloned into the GEMMs that read it (`xla.gpu.model.fusion_concat.cloned_gemm_concats`,
a `FUSION_RULES` entry) and the gathers those GEMMs read, stored and computed together by
sibling multi-output fusion (`xla.gpu.model.heap.cloned_concat_operand_spans`, a `SPAN_ADJUSTMENTS`
entry): each rule's own decision, then the prediction against XLA:GPU's deviceless compile."""

from __future__ import annotations

import jax
import pytest

from jaxmem.compiler import planner
from jaxmem.compiler.fusion import forced_fusion
from jaxmem.xla.gpu.model import fusion as gf
from jaxmem.xla.gpu.model import heap as gh
from jaxmem.xla.gpu.model.fusion_concat import (cloned_gemm_concats, concat_copy_scratch, recomputed_concat_operands,
                                                sibling_gather_spans)

from gpu_test_support import heap_cases, load_fusion_program, needs_gpu_compiler, predicted_and_xla

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


def _gather_spans(name):
    """Per scheduler of the model: (the heap case, `cloned_concat_operand_spans`' spans) for the
    fusion program `name` on H100."""
    return heap_cases(name, lambda case: (case, gh.cloned_concat_operand_spans(case)))


def test_cloned_concat_operand_spans_is_registered():
    assert gh.cloned_concat_operand_spans in gh.SPAN_ADJUSTMENTS
    assert "multi_output_fusion.cc" in sibling_gather_spans.__doc__
    assert "triton_tiling_propagation.cc" in recomputed_concat_operands.__doc__


def test_sibling_gathers_live_from_the_first_weight_gradient():
    """Three residual edge layers: each weight gradient's GEMM reads two gathers; the six share
    `h`, `s` and `r`, so all six are live from the first weight gradient to their own."""
    for name, (case, spans) in _gather_spans("sibling_gathers_of_residual_edge_layers").items():
        reads = recomputed_concat_operands(case.g, case.fused, case.device)
        assert sorted(len(v) for v in reads.values()) == [2, 2, 2], name
        assert all(case.g.ops[case.g.producer[u]].primitive == "gather" for v in reads.values() for u in v)
        pos = {oi: p for p, oi in enumerate(case.order)}
        first = min(pos[oi] for oi in reads)
        assert sorted(spans) == sorted((first, pos[oi], 16384 * 128 * 4) for oi, v in reads.items() for _ in v)


def test_one_weight_gradients_gathers_right_before_it():
    for name, (case, spans) in _gather_spans("gathers_of_one_cloned_concat").items():
        assert len(spans) == 2 and all(s[0] == s[1] for s in spans), name


@pytest.mark.slow
@needs_gpu_compiler
@pytest.mark.parametrize("device", [H100, A100])
def test_sibling_gathers_match_xla(device):
    """The residual edge layers (XLA: one `loop_gather_fusion` of six gathers) within 5% of
    XLA:GPU's total (0.981 on both devices; 0.849 with the gathers left inside their GEMMs,
    1.301 with the concatenations stored); the one-layer program within 5%; the gnn-like
    three rounds within 8% (0.926: XLA also holds the concatenations' gradients, f32[E, 384],
    longer than the model, and merges a gradient add into the gathers' kernel)."""
    for name, band in (("sibling_gathers_of_residual_edge_layers", 0.05), ("gathers_of_one_cloned_concat", 0.05),
                       ("sibling_gathers_of_cloned_concats", 0.08)):
        pred, ref, _ = predicted_and_xla(name, device)
        assert abs(pred.total_bytes / ref.total_bytes - 1) <= band, (name, pred.total_bytes / ref.total_bytes)
