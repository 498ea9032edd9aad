"""The bytes a device's collectives carry per step, read from XLA's partitioned module: held to
what the layouts must move by construction. Replicated data parallel all-reduces every gradient
once (the parameters' bytes); FSDP gathers each layer's weights (once, or again for the backward
pass) and reduce-scatters the gradients (once). The scan's 8 layers are a loop in the module:
counted once per iteration. The step is `tests/api/mesh_steps.py`'s, at smaller sizes."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from jaxmem.xla.sharding.collectives import collective_bytes, from_json
from jaxmem.xla.sharding.lowered import reference_of_traced, trace_on_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "api"))
from mesh_steps import step  # noqa: E402  (the scanned MLP stack's step, at smaller sizes here)

LAYERS, D, F = 8, 512, 2048
PARAM_BYTES = 2 * LAYERS * D * F * 2   # w1 and w2, bf16


def _args(weights: P):
    mesh = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    sds = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))  # noqa: E731
    return {"w1": sds((LAYERS, D, F), weights), "w2": sds((LAYERS, F, D), weights)}, sds((64, 128, D), P("data"))


def _moved(weights: P, xla: str = "gpu") -> dict[str, int]:
    from jaxmem.xla.gpu.compile import unavailable_reason as gpu_missing
    from jaxmem.xla.tpu.compile import unavailable_reason as tpu_missing

    if (gpu_missing if xla == "gpu" else tpu_missing)():
        pytest.skip(f"XLA:{xla.upper()}'s deviceless compiler is not installed here")
    traced = trace_on_mesh(step, _args(weights), donate_argnums=(0,))
    device = "h100-80gb" if xla == "gpu" else "tpu-v5e-16gb"
    ref = reference_of_traced(traced, xla=xla, device=device, top=0, use_cache=False)
    moved = from_json(ref["collectives"])
    assert moved is not None and moved.exact
    return moved.by_kind


@pytest.mark.parametrize("xla", ["gpu", "tpu"])
def test_replicated_data_parallel_all_reduces_each_gradient_once(xla):
    moved = _moved(P(), xla)
    assert moved == {"all-reduce": PARAM_BYTES}   # the gradients; the loss is not an output


def test_xla_tpu_moves_fsdp_weights_in_chunks_round_its_ring():
    # XLA:TPU turns FSDP's gathers and scatters into windowed loops of collective-permutes, one
    # 1/8 chunk of a layer's weights per device and step: at least the 7 chunks a ring needs for
    # each of the three passes (forward gather, backward gather, gradient scatter), in whole chunks.
    moved = _moved(P(None, "data", None), "tpu")
    chunk = PARAM_BYTES // 8
    assert set(moved) == {"collective-permute"}
    assert moved["collective-permute"] % chunk == 0
    assert 2 * 7 * chunk <= moved["collective-permute"] <= 4 * PARAM_BYTES


def test_fsdp_gathers_the_weights_for_each_pass_and_scatters_the_gradients_once():
    moved = _moved(P(None, "data", None))
    # XLA:GPU may keep the forward pass's gathered weights for the backward one (it does at this
    # size) or gather them again: once or twice the parameters, never a share of a layer's.
    assert moved["all-gather"] in (PARAM_BYTES, 2 * PARAM_BYTES)
    assert moved["reduce-scatter"] == PARAM_BYTES


def test_a_loop_whose_bound_cannot_be_read_counts_once_and_says_so():
    text = """
%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0} all-reduce(%x), to_apply=%add
  ROOT %t = (s32[], f32[8]{0}) tuple(%x, %ar)
}
ENTRY %main (a: (s32[], f32[8])) -> (s32[], f32[8]) {
  %a = (s32[], f32[8]{0}) parameter(0)
  ROOT %w = (s32[], f32[8]{0}) while(%a), condition=%cond, body=%body
}
"""
    moved = collective_bytes(text)
    assert moved.by_kind == {"all-reduce": 32} and not moved.exact
    assert collective_bytes("not a module").total == 0 and from_json([1]) is None
