"""`dynamic_update_slice` as XLA:GPU fuses it (`xla.gpu.model.predict.updates_read_inside`), checked against
XLA:GPU's deviceless compiles on both devices: an update read only by loop, reduction and
concatenate kernels is computed inside each of them and never stored; one that is returned is
stored; a costly value it updates, read through it by several kernels, is stored once; and an
update of a split-K GEMM's result does not make its readers store it (`xla.gpu.model.splitk`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxmem.compiler import planner
from jaxmem.xla.gpu.model import predict as gpu_model

from gpu_test_support import load_fusion_program, needs_gpu_compiler, predicted_and_xla

DEVICES = ["h100-80gb", "a100-40gb"]


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["update_read_by_reduction", "update_of_exp_read_twice",
                                  "update_returned_and_read"])
def test_update_stored_where_xla_stores_it(name, device):
    pred, ref, _ = predicted_and_xla(name, device)
    # XLA's temp is 0 or the one 16 MiB exponential: the model must land on the same side
    assert abs(pred.temp_bytes - ref.temp_bytes) <= 4096, (pred.temp_bytes, ref.temp_bytes)


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
def test_decode_step_stores_no_layer_cache(device):
    pred, ref, _ = predicted_and_xla("decode_stacked_cache", device)
    layer_cache = 16 * 512 * 8 * 64 * 2
    # XLA holds less than one layer's cache beside arguments and outputs; so must the model
    # (the figures left are the attention's small f32 scores: 0.9 MB predicted, 2.5 MB by XLA)
    assert ref.temp_bytes < layer_cache
    assert pred.temp_bytes < layer_cache, (pred.temp_bytes, ref.temp_bytes)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.05, (pred.total_bytes, ref.total_bytes)


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
def test_loop_carry_updated_in_place_update_after_update(device):
    """The loop state holds every update of the carried cache (`planner._update_chain`): no
    16 MiB copy in the body, in XLA's figure, the model's, or jaxmem's own plan."""
    import jaxmem

    pred, ref, _ = predicted_and_xla("loop_carry_updated_twice", device, donate=(0,))
    cache = 16 << 20
    assert ref.temp_bytes < cache // 16 and ref.alias_bytes == cache
    assert pred.temp_bytes < cache // 16, (pred.temp_bytes, ref.temp_bytes)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.01
    _, factory = load_fusion_program("loop_carry_updated_twice")
    fn, args = factory()
    plan = jaxmem.plan(fn, *args, donate_argnums=(0,), xla=False)
    # the cache, an argument, and at most one 4 MiB slice of it: no second cache
    assert plan.valid and plan.peak_bytes < cache + cache // 2, plan.peak_bytes


def test_update_is_computed_inside_its_readers_not_when_returned():
    # structure alone, no compiler: which updates the model computes inside their readers
    def fn(p, u, i):
        y = jax.lax.dynamic_update_slice(p, u, (i, 0))        # read by a reduction: inside
        z = jax.lax.dynamic_update_slice(p * 2, u, (i, 0))    # returned: stored
        w = jax.lax.dynamic_update_slice(z, u, (i + 1, 0))    # updates z in place: z stored
        return jnp.sum(y, 0), z, w
    closed = jax.make_jaxpr(fn)(jnp.ones((64, 32)), jnp.ones((2, 32)), jnp.array(1, jnp.int32))
    g = planner.inlined(closed)
    roles = planner.value_roles(g, [False] * len(g.invars), (), ())
    inside = gpu_model.updates_read_inside(g, roles)
    updates = [op.index for op in g.ops if op.primitive == "dynamic_update_slice"]
    assert [oi in inside for oi in updates] == [True, False, False]
