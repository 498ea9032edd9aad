"""XLA:GPU behaviours past the suite, each on a small program against XLA:GPU compiled deviceless
on both devices (`fusion_programs.py`):

- split-K of 8-bit GEMMs: s8 x s8 -> s32 and float8 x float8 -> f32 split like the others
  (only s32 operands are skipped), partials in the default accumulator type; on A100, without
  float8 tensor cores, the float8 GEMM is cuBLASLt on float16 copies of its operands with a
  4 MiB workspace (`xla.gpu.model.predict.float8_fallback_scratch`);
- split-K inside while and scan bodies (the rewriter visits every non-fusion computation), the
  bodies modelled by the GPU model itself (`xla.gpu.model.scratch.loop_scratch`);
- a GEMM operand read through a transpose is the GEMM's operand for the prologue rule
  (`xla.gpu.model.predict.read_by_gemm`);
- newer JAX's data-movement primitives (`tile`, `stack`, `split`, `unstack`) computed inside
  their readers.
"""

from __future__ import annotations

import pytest

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.xla.gpu.compile import xla_gpu_reference
from jaxmem.xla.gpu.model.predict import predict
from jaxmem.xla.gpu.model.splitk import accumulator_bits, dot_split

from gpu_test_support import needs_gpu_compiler, FUSION, load_fusion_program

DEVICES = ("h100-80gb", "a100-40gb")
MIB = 2 ** 20


def _traced(name: str):
    _, factory = load_fusion_program(name)
    fn, args = factory()
    return ja.trace(fn, args, {}, ())


def _predict_and_reference(name: str, device: str):
    traced = _traced(name)
    pred = predict(traced.closed_jaxpr, donated=[False] * len(traced.in_avals), device=device)
    ref = xla_gpu_reference(f"{FUSION}:{name}", device=device, top=0)
    assert pred.argument_bytes == ref.argument_bytes
    assert abs(pred.output_bytes - ref.output_bytes) <= 64   # XLA counts a tuple's pointer table
    return pred, ref


def _dot_result_bytes(name: str) -> int:
    """Bytes of the largest dot_general result in the program, loop bodies included."""
    best = 0

    def walk(jaxpr) -> None:
        nonlocal best
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                aval = eqn.outvars[0].aval
                best = max(best, aval.size * aval.dtype.itemsize)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(_traced(name).closed_jaxpr.jaxpr)
    return best


def test_8bit_gemms_split_and_s32_operands_do_not():
    """The factor of an 8-bit GEMM is the cost model's (int8 and float8 as any other); a GEMM
    with s32 operands is never split; the partials are s32 / f32 (4 bytes) or f64."""
    import jax
    import jax.numpy as jnp

    def gemm(dtype, out):
        fn = lambda x, w: jax.lax.dot(x, w, preferred_element_type=out)
        g = ja.inline(jax.make_jaxpr(fn)(jnp.ones((512, 4096), dtype), jnp.ones((4096, 512), dtype)))
        return g, next(op for op in g.ops if op.primitive == "dot_general")

    for dtype, out in ((jnp.int8, jnp.int32), (jnp.float8_e4m3fn, jnp.float32)):
        g, op = gemm(dtype, out)
        assert (dot_split(g, op, "h100-80gb"), dot_split(g, op, "a100-40gb")) == (8, 4)
    g, op = gemm(jnp.int32, jnp.int32)
    assert dot_split(g, op, "h100-80gb") == 1
    assert accumulator_bits("int8", "int8", "int32") == 32 and accumulator_bits("float64", "float64", "float64") == 64


SPLIT_PROGRAMS = ["splitk_int8_gemm", "splitk_fp8_gemm", "splitk_in_while_body", "splitk_in_scan_body"]


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", SPLIT_PROGRAMS)
def test_split_partials_of_8bit_gemms_and_loop_bodies_match_xla_gpu_temp(name, device):
    """The predicted temp is XLA's (within 2%), and XLA's temp holds more than twice the dot's
    unsplit result: the partials (what the model missed before these rules)."""
    pred, ref = _predict_and_reference(name, device)
    assert abs(pred.temp_bytes / ref.temp_bytes - 1) <= 0.02, (pred.temp_bytes, ref.temp_bytes)
    assert ref.temp_bytes >= 2 * _dot_result_bytes(name), ref.temp_bytes


@needs_gpu_compiler
def test_float8_gemm_without_float8_tensor_cores_takes_a_workspace_and_f16_operands():
    """A100 (compute capability 8.0) holds the cuBLASLt workspace and the float16 operand copies
    beside the partials; H100 holds the partials only."""
    h100 = xla_gpu_reference(f"{FUSION}:splitk_fp8_gemm", device="h100-80gb", top=0)
    a100 = xla_gpu_reference(f"{FUSION}:splitk_fp8_gemm", device="a100-40gb", top=0)
    # partials f32[s,256,512]: 8 ways on H100, 4 on A100; A100 adds 4 MiB + 2 B x (256 + 512) x 2048
    assert h100.temp_bytes == 8 * 256 * 512 * 4
    assert a100.temp_bytes >= 4 * 256 * 512 * 4 + 4 * MIB + 2 * (256 + 512) * 2048


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
def test_gemm_operand_read_through_a_transpose_is_stored_where_xla_stores_it(device):
    """`x @ (a - m).T`: XLA stores the 1 MiB subtract (not input-worth fusing into the GEMM)."""
    pred, ref = _predict_and_reference("gemm_operand_through_transpose", device)
    assert ref.temp_bytes >= MIB
    assert abs(pred.temp_bytes / ref.temp_bytes - 1) <= 0.02, (pred.temp_bytes, ref.temp_bytes)


MOVEMENT_PROGRAMS = {"tile_fused": {"tile"}, "stack_fused": {"stack"}, "split_unstack_fused": {"split", "unstack"}}


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(MOVEMENT_PROGRAMS))
def test_new_movement_primitives_are_computed_inside_their_readers(name, device):
    """The jaxpr holds the primitive (so the program tests it); XLA stores none of its results
    (temp under 1 MiB, each is 8 MiB or more), and neither does the prediction."""
    traced = _traced(name)
    primitives = {eqn.primitive.name for eqn in traced.closed_jaxpr.jaxpr.eqns}
    assert MOVEMENT_PROGRAMS[name] <= primitives, primitives
    pred, ref = _predict_and_reference(name, device)
    assert ref.temp_bytes < MIB and pred.temp_bytes < MIB, (pred.temp_bytes, ref.temp_bytes)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.01


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["splitk_padded_contraction", "splitk_padded_contraction_bf16"])
def test_split_contraction_padded_operands_are_stored_beside_the_partials(name, device):
    """A contraction of 1000 split 8 (H100) or 4 (A100) ways is padded to 1024 or 1008 (float32)
    and 1024 (bfloat16): XLA's temp is the partials and both padded operands, byte for byte
    (`xla.gpu.model.splitk.padded_operand_bytes`); the partials alone fall 4.5 or 2.3 MiB short."""
    from jaxmem.xla.gpu.model.splitk import padded_k

    pred, ref = _predict_and_reference(name, device)
    assert pred.temp_bytes == ref.temp_bytes, (pred.temp_bytes, ref.temp_bytes)
    split = 8 if device.startswith("h100") else 4
    bits = 32 if name.endswith("contraction") else 16
    partials = split * 128 * 1000 * 4
    assert ref.temp_bytes == partials + (128 + 1000) * padded_k(1000, split, bits, bits) * bits // 8


def test_a_broadcast_stops_the_stored_readers_walk():
    """`xla.gpu.model.splitk._broadcast_downstream`: the split Dense's halves broadcast over the feature
    map; the modulated map, read twice, is not stored (it was, 4 MiB, before the rule)."""
    from jaxmem.compiler import planner
    from jaxmem.xla.gpu.model import splitk as gs

    g = planner.inlined(_traced("splitk_film_broadcast").closed_jaxpr)
    wide = [op for op in g.ops if op.primitive == "mul" and any(len(g.shapes[u]) == 4 and g.shapes[u][1] == 1
                                                                 for u in op.inputs)]
    assert wide and all(gs._broadcast_downstream(g, op, next(u for u in op.inputs if g.shapes[u][1] == 1))
                        for op in wide)
    for device in DEVICES:
        traced = _traced("splitk_film_broadcast")
        assert predict(traced.closed_jaxpr, donated=[False] * 3, device=device).temp_bytes < MIB


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
def test_splitk_film_broadcast_against_xla(device):
    pred, ref = _predict_and_reference("splitk_film_broadcast", device)
    assert ref.temp_bytes < MIB and abs(pred.total_bytes / ref.total_bytes - 1) < 0.01
