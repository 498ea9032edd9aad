"""The performance model's re-reads (`xla.gpu.model.performance.Device.reread_ns`, `Kernel.rereads`): an operand a
loop kernel reads in several places, and a constant it broadcasts, cost their reads past the
first at the cache's bandwidth (gpu_performance_model_base.cc, ReadTimeWithDRAMHeuristic), which
decides whether priority fusion recomputes a transcendental in each reader."""

from __future__ import annotations

import re

import pytest

from jaxmem.xla.gpu.compile import xla_gpu_reference
from jaxmem.xla.gpu.model.performance import L1_CACHE_SIZE_PER_SM, L2_CACHE_SPEEDUP, device_numbers

from gpu_test_support import FUSION, load_fusion_program, needs_gpu_compiler, program_fusion

H100, A100 = "h100-80gb", "a100-40gb"


def test_reread_bandwidth_by_cache_level():
    dev = device_numbers(H100)
    assert dev.l2_cache_size == 50 << 20
    assert dev.reread_ns(100, 100) == 0.0                          # read once: nothing re-read
    big = dev.l2_cache_size + 1                                     # past L2: from DRAM
    assert dev.reread_ns(big, 2 * big) == pytest.approx(big / dev.bandwidth * 1e9)
    mid = 32 << 20                                                  # in L2
    assert dev.reread_ns(mid, 2 * mid) == pytest.approx(mid / dev.bandwidth / L2_CACHE_SPEEDUP * 1e9)
    small = L1_CACHE_SIZE_PER_SM * dev.cores - 1                    # in L1 too
    assert dev.reread_ns(small, 2 * small) < dev.reread_ns(mid, mid + small)
    assert device_numbers(A100).l2_cache_size == 40 << 20


def _tanh_stored(name, device):
    g, fused = program_fusion(name, device)
    return [not fused[op.outputs[0]] for op in g.ops if op.primitive == "tanh"]


@pytest.mark.parametrize("device", [H100, A100])
def test_wide_gelu_decided_with_rereads(device):
    """A 32 MiB tanh gelu: recomputed in both readers on H100 (the GEMM output read three times
    by the tanh chain, the backward's kernel reading it and its constants again: the unfused
    loop kernels, bound by memory, cost more than the fused ones, bound by compute), stored on
    A100 (a third of the compute)."""
    module, _ = load_fusion_program("gelu_step_wide")
    assert _tanh_stored("gelu_step_wide", device) == [module.TRANSCENDENTAL_STORED[("gelu_step_wide", device)]]


@needs_gpu_compiler
def test_wide_gelu_recomputed_on_h100_as_xla_gpu():
    ref = xla_gpu_reference(f"{FUSION}:gelu_step_wide", device=H100, top=10)
    xla_stored = any(re.search(r"^loop_\w*fusion(\.\d+)?\{1\}$", b["name"]) and b["kind"] == "temporary"
                     for b in ref.peak_buffers)
    assert xla_stored is False
    assert _tanh_stored("gelu_step_wide", H100) == [False]
