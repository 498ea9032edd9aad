"""A cheap value a column reduction on few blocks reads is stored (`xla.gpu.model.reduction`,
`xla.gpu.model.fusion_cost.slow_reduction_stored`): the performance model caps a kernel's bandwidth
by its blocks (gpu_performance_model_base.cc, AdjustBandwidth), and a per-channel sum of 4096
rows of NHWC data runs on 4 (reduction.cc, ColumnReductionFusion)."""

from __future__ import annotations

import pytest

from jaxmem.xla.gpu.model.performance import device_numbers
from jaxmem.xla.gpu.model.reduction import column_reduction_blocks, reduction_dimensions

from gpu_test_support import needs_gpu_compiler, predicted_and_xla, program_fusion

H100, A100 = "h100-80gb", "a100-40gb"
NHWC, NCHW = (0, 1, 2, 3), (0, 3, 1, 2)


def test_column_reduction_blocks_as_xla_launches_them():
    # the launches in the VLOG of a Keras CNN's reductions on H100 (blocks x 1024 threads)
    assert column_reduction_blocks((64, 8, 8, 256), (0, 1, 2), NHWC, 4) == 4        # [1, 4096, 256]
    assert column_reduction_blocks((256, 256, 64), (1,), (0, 1, 2), 4) == 256       # a split's first pass
    assert column_reduction_blocks((256, 64), (0,), (0, 1), 4) == 1                 # ...and its second
    assert column_reduction_blocks((64, 8, 8, 256), (1, 2), NHWC, 4) == 256         # global average pool
    assert column_reduction_blocks((64, 16, 16, 128), (0, 1, 2), NHWC, 4) is None   # 16384 rows: split
    assert column_reduction_blocks((64, 8, 8, 256), (0, 1, 2), NCHW, 4) is None     # A100's NCHW: a row one
    assert reduction_dimensions((64, 8, 8, 256), (0, 1, 2), NCHW) == (True, (64, 256, 64))
    assert column_reduction_blocks((512, 16), (0,), (0, 1), 4) == 1                 # SmallColumnReductionFusion


def test_bandwidth_capped_by_blocks():
    dev = device_numbers(H100)
    assert dev.block_bandwidth(dev.bandwidth, 4) == pytest.approx(4 * 1.98e9 * 32)
    assert dev.block_bandwidth(dev.bandwidth, 256) == dev.bandwidth
    assert dev.block_bandwidth(dev.bandwidth, None) == dev.bandwidth


def _centred_stored(name, device):
    g, fused = program_fusion(name, device)
    return [not fused[op.outputs[0]] for op in g.ops if op.primitive == "sub" and len(g.shapes[op.outputs[0]]) == 4]


@pytest.mark.parametrize("device", [H100, A100])
def test_centred_value_stored_for_a_slow_column_reduction(device):
    assert _centred_stored("bn_column", device) == [True]
    assert _centred_stored("bn_column_split", device) == [False]


@needs_gpu_compiler
@pytest.mark.parametrize("device", [H100, A100])
@pytest.mark.parametrize("name", ["bn_column", "bn_column_split"])
def test_bn_column_as_xla_gpu(name, device):
    pred, ref, _ = predicted_and_xla(name, device)
    # bn_column: XLA's temp holds the 4 MiB centred value (before the rule, 4 KiB predicted)
    assert abs(pred.total_bytes - ref.total_bytes) <= 2048
