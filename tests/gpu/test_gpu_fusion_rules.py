"""Each registered fusion rule of the XLA:GPU model (`xla.gpu.model.fusion.PRODUCER_RULES`,
`FUSION_RULES`) on a small program that triggers it: the rule's own decision, checked against
XLA:GPU's deviceless compile where one is cheap (`xla_gpu_reference`, cached per session) or
against the byte figure worked out by hand."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxmem.compiler import planner
from jaxmem.compiler.fusion import forced_fusion
from jaxmem.xla.gpu.model import fusion as gf
from jaxmem.xla.gpu.compile import xla_gpu_reference
from jaxmem.xla.gpu.model.predict import predict
from jaxmem.xla.gpu.model.fusion_producers import (gemm_prologue_not_worth_fusing, narrowing_cast_shared,
                                                   new_movement_read_by_gemm, reader_does_not_absorb,
                                                   reread_by_its_readers, stored_sum_read_by_several,
                                                   too_many_readers, transcendental_into_gemm,
                                                   transcendental_not_duplicated)

from gpu_test_support import FUSION, load_fusion_program, needs_gpu_compiler, predicted_and_xla

H100, A100 = "h100-80gb", "a100-40gb"
F32 = jnp.float32


def _context(fn, args, device=H100, shared=True, epilogues=False, reread=False):
    """(context, fused flags so far) for `fn(*args)` as the prediction builds them; the producer
    pass has run, so `costly` is filled, but the flags are the forced ones."""
    g = planner.inlined(jax.make_jaxpr(fn)(*args))
    roles = planner.value_roles(g, [False] * len(g.invars), (), ())
    forced = forced_fusion(g, roles)
    ctx = gf.fusion_context(g, roles, device=device, store_shared_casts=shared, output_epilogues=epilogues,
                            store_reread_producers=reread, fused=forced)
    gf.fuse_cheap_producers(ctx, list(forced))
    return ctx, list(forced)


def _asked(rule, ctx, fused, primitive, k=0):
    """The producer rule's answer for the `k`-th op of `primitive` (its first output)."""
    op = [op for op in ctx.g.ops if op.primitive == primitive][k]
    return rule(ctx, fused, op, op.outputs[0])


def _changed(ctx, changes, primitive):
    """The flags `changes` sets on the outputs of `primitive`'s ops, in program order."""
    return [changes.get(op.outputs[0]) for op in ctx.g.ops if op.primitive == primitive]


def test_the_registries_hold_every_rule_once_in_order():
    assert gf.FUSION_RULES[0] is gf.fuse_cheap_producers
    assert len(set(gf.PRODUCER_RULES)) == len(gf.PRODUCER_RULES) == 10
    assert all(rule.__doc__ for rule in gf.PRODUCER_RULES + gf.FUSION_RULES)


def test_read_by_slow_reduction():
    # the centred value of batch-norm statistics over 4096 NHWC rows (4 blocks): stored; over
    # 16384 rows (split over many blocks): fused (XLA:GPU alike: test_gpu_slow_reductions.py)
    for name, stored in (("bn_column", True), ("bn_column_split", False)):
        _, factory = load_fusion_program(name)
        ctx, fused = _context(*factory(), device=A100)
        op = next(op for op in ctx.g.ops if op.primitive == "sub" and len(ctx.g.shapes[op.outputs[0]]) == 4)
        assert gf.read_by_slow_reduction(ctx, fused, op, op.outputs[0]) is stored
    assert gf.PRODUCER_RULES[-1] is gf.read_by_slow_reduction


def test_too_many_readers():
    x = jnp.ones((64, 64), F32)
    def readers(n):
        def fn(x):
            y = x * 2.0
            return sum(jnp.sin(y + k) for k in range(n))
        return fn
    many, few = readers(9), readers(2)
    assert _asked(too_many_readers, *_context(many, (x,)), "mul") is True
    assert _asked(too_many_readers, *_context(few, (x,)), "mul") is False


@needs_gpu_compiler
@pytest.mark.parametrize("name", ["reread_cheap_producer_stored", "reread_cheap_producer_fused"])
def test_reread_by_its_readers_matches_xla(name):
    module, factory = load_fusion_program(name)
    ctx, fused = _context(*factory(), reread=True)
    ref = xla_gpu_reference(f"{FUSION}:{name}", device=H100, top=0)
    xla_stores_h = ref.temp_bytes >= module.BIG
    assert xla_stores_h == module.STORED[name]
    # h = x * 2 + 1: the add's result is what the expert matvec and the scatter broadcast
    assert _asked(reread_by_its_readers, ctx, fused, "add") is xla_stores_h
    off, _ = _context(*factory(), reread=False)
    assert off.reread == set()


def test_new_movement_read_by_gemm():
    qkv, w = jnp.ones((128, 192), F32), jnp.ones((64, 16), F32)
    heads = lambda qkv, w: [part @ w for part in jnp.split(qkv, 3, axis=-1)]
    summed = lambda qkv, w: [jnp.sum(part) for part in jnp.split(qkv, 3, axis=-1)]
    assert _asked(new_movement_read_by_gemm, *_context(heads, (qkv, w)), "split") is True
    assert _asked(new_movement_read_by_gemm, *_context(summed, (qkv, w)), "split") is False


def test_reader_does_not_absorb():
    x, u = jnp.ones((64, 64), F32), jnp.ones((1, 64), F32)
    into_buffer = lambda x, u: jax.lax.dynamic_update_slice(x * 2.0, u, (3, 0)) @ x
    into_sum = lambda x, u: jnp.sum(x * 2.0)
    assert _asked(reader_does_not_absorb, *_context(into_buffer, (x, u)), "mul") is True
    assert _asked(reader_does_not_absorb, *_context(into_sum, (x, u)), "mul") is False


def test_transcendental_into_gemm():
    x, w = jnp.ones((256, 256), F32), jnp.ones((256, 8), F32)
    assert _asked(transcendental_into_gemm, *_context(lambda x, w: jnp.tanh(x) @ w, (x, w)), "tanh") is True
    assert _asked(transcendental_into_gemm, *_context(lambda x, w: (x * 2.0) @ w, (x, w)), "mul") is False


def test_gemm_prologue_not_worth_fusing():
    m, a, b, w = jnp.ones((256, 256), bool), jnp.ones((256, 256), F32), jnp.ones((256, 256), F32), jnp.ones((256, 8), F32)
    # the select reads three tensors to write one, `a` is read elsewhere too: not worth it
    masked = lambda m, a, b, w: (jnp.where(m, a, b) @ w, a.sum())
    scaled = lambda m, a, b, w: (a * 2.0) @ w
    assert _asked(gemm_prologue_not_worth_fusing, *_context(masked, (m, a, b, w)), "select_n") is True
    assert _asked(gemm_prologue_not_worth_fusing, *_context(scaled, (m, a, b, w)), "mul") is False
    # jaxmem's own plan (no device) keeps the select in the GEMM's operand
    assert _asked(gemm_prologue_not_worth_fusing, *_context(masked, (m, a, b, w), device=None), "select_n") is False


@pytest.mark.parametrize("device", [H100, A100])
def test_transcendental_not_duplicated_as_xla_decides(device):
    """gelu's tanh, read by two loop kernels: recomputed on H100, stored on A100 (XLA's decision
    recorded in `fusion_programs.TRANSCENDENTAL_STORED`, checked against XLA in test_gpu_model)."""
    module, factory = load_fusion_program("gelu_step")
    ctx, fused = _context(*factory(), device=device)
    assert _asked(transcendental_not_duplicated, ctx, fused, "tanh") is module.TRANSCENDENTAL_STORED[("gelu_step", device)]
    plan_ctx, plan_fused = _context(*factory(), device=None)
    assert _asked(transcendental_not_duplicated, plan_ctx, plan_fused, "tanh") is True   # no device: stored


@needs_gpu_compiler
@pytest.mark.parametrize("device", [H100, A100])
def test_stored_sum_read_by_several(device):
    """The residual stream's sums of `bf16_residual_mlp` (each `y + mlp(norm(y))`, read by the
    next LayerNorm's ops, the next sum and the backward) are stored on A100, as XLA stores them
    (`input_add_reduce_fusion{2}` f32); on H100 the sum is bfloat16 and its widening convert is
    one reader of two, so this rule leaves it (XLA stores it there too, the model the same bytes
    as bfloat16 branch results: the program's total is matched on both); `residual_relu`'s sum, read by a relu and its
    gradient's mask only, is computed in both (XLA:GPU's temp holds the masked product alone,
    16 MiB, no sum beside it); a sum of two arguments read by one reduction is computed inside
    it; no device (jaxmem's own plan): never stored by this rule."""
    _, factory = load_fusion_program("bf16_residual_mlp")
    ctx, fused = _context(*factory(blocks=2), device=device)
    sums = [op for op in ctx.g.ops if op.primitive == "add" and len(ctx.g.users[op.outputs[0]]) >= 2
            and ctx.g.shapes[op.outputs[0]] == (32, 256, 256)]
    assert sums and all(stored_sum_read_by_several(ctx, fused, op, op.outputs[0]) == (device == A100) for op in sums)
    _, relu_factory = load_fusion_program("residual_relu")
    relu_ctx, relu_fused = _context(*relu_factory(), device=device)
    assert _asked(stored_sum_read_by_several, relu_ctx, relu_fused, "add") is False
    ref = xla_gpu_reference(f"{FUSION}:residual_relu", device=device, top=0)
    assert ref.temp_bytes < 2 * 4096 * 1024 * 4, ref.temp_bytes
    x = jnp.ones((1024, 1024), F32)
    once, once_fused = _context(lambda a, b: jnp.sum(a + b, axis=1), (x, x), device=device)
    assert _asked(stored_sum_read_by_several, once, once_fused, "add") is False
    plan_ctx, plan_fused = _context(*factory(blocks=2), device=None)
    assert not any(stored_sum_read_by_several(plan_ctx, plan_fused, op, op.outputs[0])
                   for op in plan_ctx.g.ops if op.primitive == "add")


def test_narrowing_cast_shared():
    w, x, y = jnp.ones((512, 512), F32), jnp.ones((8, 512), jnp.bfloat16), jnp.ones((512, 8), jnp.bfloat16)
    def twice(w, x, y):
        c = w.astype(jnp.bfloat16)
        return x @ c, c @ y
    once = lambda w, x, y: x @ w.astype(jnp.bfloat16)
    assert _asked(narrowing_cast_shared, *_context(twice, (w, x, y)), "convert_element_type") is True
    assert _asked(narrowing_cast_shared, *_context(once, (w, x, y)), "convert_element_type") is False
    assert _asked(narrowing_cast_shared, *_context(twice, (w, x, y), shared=False), "convert_element_type") is False


def test_fuse_cheap_producers_stores_no_gathered_rows():
    """exp(w[idx] * 2).sum(1): gather, multiply and exp inside the reduction; XLA's total is the
    argument and output bytes alone: 8 * 1024 * 4 + 256 * 4 (idx) + 256 * 4 (the sums)."""
    fn = lambda w, idx: jnp.exp(w[idx] * 2.0).sum(axis=1)
    args = (jnp.ones((8, 1024), F32), jnp.arange(256) % 8)
    ctx, fused = _context(fn, args)
    changes = gf.fuse_cheap_producers(gf.fusion_context(ctx.g, ctx.roles, device=H100, store_shared_casts=True,
                                                        output_epilogues=False, store_reread_producers=False,
                                                        fused=fused), fused)
    assert _changed(ctx, changes, "gather") == [True] and _changed(ctx, changes, "exp") == [True]
    pred = predict(jax.make_jaxpr(fn)(*args), device=H100)
    assert (pred.temp_bytes, pred.total_bytes) == (0, 8 * 1024 * 4 + 256 * 4 + 256 * 4)


@needs_gpu_compiler
def test_shared_masks_stored_matches_xla():
    """Without a device the producer pass fuses the mask (with one, the input-worth rule
    already stores it); the rule stores it as XLA does."""
    module, factory = load_fusion_program("relu_mask_read_by_gemms")
    ctx, fused = _context(*factory(), device=None)
    after = list(fused)
    for v, f in gf.fuse_cheap_producers(ctx, fused).items():
        after[v] = f
    changes = gf.shared_masks_stored(ctx, after)
    ref = xla_gpu_reference(f"{FUSION}:relu_mask_read_by_gemms", device=H100, top=0)
    assert (ref.temp_bytes >= module.BIG) is module.STORED["relu_mask_read_by_gemms"] is True
    assert _changed(ctx, changes, "select_n") == [False]
    assert gf.shared_masks_stored(_context(*factory(), device=None, shared=False)[0], after) == {}


def test_softmax_fusions():
    """log-softmax's shifted rows are inside the Triton fusion; its result, read by the loss's
    gather (outside the fusion), is stored."""
    fn = lambda x, t: jnp.take_along_axis(jax.nn.log_softmax(x), t[:, None], axis=1).sum()
    ctx, fused = _context(fn, (jnp.ones((256, 1024), F32), jnp.zeros((256,), jnp.int32)))
    changes = gf.softmax_fusions(ctx, fused)
    subs = _changed(ctx, changes, "sub")
    assert subs[0] is True and subs[-1] is False


def test_widened_softmax_roots_stored():
    """Log-softmax over bfloat16 logits, with its backward: the float32 shifted logits are stored."""
    _, factory = load_fusion_program("bf16_log_softmax_grad")
    ctx, fused = _context(*factory())
    changes = gf.widened_softmax_roots_stored(ctx, fused)
    assert changes and set(changes.values()) == {False}
    assert all(str(ctx.g.dtypes[v]) == "float32" for v in changes)
    assert gf.widened_softmax_roots_stored(_context(*factory(), device=None)[0], fused) == {}


def test_output_epilogues_write_the_sgd_update_from_the_gemm():
    """`w - 0.1 * (x.T @ d)`: the GEMM writes the update; its result and the scaled gradient are
    computed inside it (never stored), the update is."""
    fn = lambda w, x, d: w - 0.1 * (x.T @ d)
    args = (jnp.ones((256, 256), F32), jnp.ones((64, 256), F32), jnp.ones((64, 256), F32))
    ctx, fused = _context(fn, args, epilogues=True)
    changes = gf.output_epilogues(ctx, fused)
    assert _changed(ctx, changes, "dot_general") == [True] and _changed(ctx, changes, "mul") == [True]
    assert _context(fn, args, epilogues=False)[0].output_epilogues is False
    assert gf.output_epilogues(_context(fn, args, epilogues=False)[0], fused) == {}


def test_a_reduction_over_size_one_dimensions_is_a_squeeze():
    """algebraic_simplifier.cc (HandleReduce): a reduce that keeps every element is a reshape;
    the model's simplified program has a squeeze there, which fuses into its readers."""
    from jaxmem.xla.gpu.model.ops import strength_reduced
    module, factory = load_fusion_program("scatter_unit_sum")
    g = strength_reduced(planner.inlined(jax.make_jaxpr(factory()[0])(*factory()[1])))
    kinds = [op.primitive for op in g.ops]
    assert "squeeze" in kinds and kinds.count("reduce_sum") == 2


@needs_gpu_compiler
@pytest.mark.parametrize("device", [H100, A100])
def test_a_reduction_over_size_one_dimensions_stores_nothing_as_xla(device):
    """The scatter's f32[512,1,1024] summed over its size-one axis: XLA:GPU stores only the
    scatter (2 MiB, and a 16-byte tuple of the two reductions); the sum is never stored."""
    pred, ref, _ = predicted_and_xla("scatter_unit_sum", device)
    assert ref.temp_bytes - 16 == pred.temp_bytes == 512 * 1024 * 4
