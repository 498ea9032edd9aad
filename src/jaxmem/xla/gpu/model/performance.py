"""XLA:GPU's cost of duplicating an expensive elementwise chain into several consumers.

XLA:GPU's priority fusion fuses a producer into all of its consumers only when its performance
model says the fused kernels run faster than the unfused ones
(priority_fusion.cc: CalculateProducerPriority; gpu_performance_model.cc:
EstimateRunTimesForPriorityFusion):

    unfused = launch * (n + 1) + t(producer) + sum_i t(consumer_i)
    fused   = launch * n       + sum_i t(producer fused into consumer_i)
    t(kernel) = compute + memory - 0.95 * min(compute, memory)

with a launch overhead of 1 us, memory time = bytes / the device's bandwidth (an operand a kernel
reads in several places, or a constant it broadcasts, read again at the L2 or L1 cache's
bandwidth where it fits: `Device.reread_ns`), compute time =
flops / (cores * FPUs per core * clock * 2), and an elementwise op's flops per element read from
XLA's measured per-device profile (hlo_op_profiles_data.h: clock cycles per op and type, per
compute capability; 3 for an op the profile lacks). Duplicating a transcendental chain costs
compute in every consumer and saves its output's write and reads; so the answer depends on the
device: gelu's tanh (467 cycles on sm_90, 504 on sm_80) is duplicated on an H100 in float32 but
stored on an A100 (a third of the H100's compute against half its bandwidth) and in bfloat16
(half the bytes saved); silu's exp (79 cycles on sm_90, absent from sm_80's profile) is
duplicated on both. The device's numbers come from XLA's target description (`targets/`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from jaxmem.compiler.rules import GPU_NOT_DUPLICATED, GPU_UPCAST_HLO_OPS, rule

# XLA's elementwise profile (clock cycles per element), the entries for the ops below:
# hlo_op_profiles_data.h, as built into the CUDA plugin that compiles here (jax 0.10.2).
# Keyed by compute capability, then (HLO opcode, element type).
OP_PROFILES: dict[str, dict[tuple[str, str], int]] = {
    "sm_70": {("add", "F16"): 9, ("add", "F32"): 6, ("atan2", "F16"): 449, ("atan2", "F32"): 406,
              ("cbrt", "F16"): 226, ("cbrt", "F32"): 189, ("cosine", "F16"): 425, ("cosine", "F32"): 373,
              ("divide", "F16"): 73, ("divide", "F32"): 21, ("exponential", "F16"): 128,
              ("exponential", "F32"): 79, ("exponential-minus-one", "F16"): 241,
              ("exponential-minus-one", "F32"): 205, ("log", "F16"): 232, ("log", "F32"): 180,
              ("log-plus-one", "F16"): 266, ("log-plus-one", "F32"): 217, ("multiply", "F16"): 9,
              ("multiply", "F32"): 6, ("power", "F16"): 709, ("power", "F32"): 673, ("rsqrt", "F16"): 122,
              ("rsqrt", "F32"): 76, ("sine", "F16"): 425, ("sine", "F32"): 373, ("sqrt", "F16"): 122,
              ("sqrt", "F32"): 76, ("subtract", "F16"): 9, ("subtract", "F32"): 6, ("tanh", "F16"): 284,
              ("tanh", "F32"): 269},
    "sm_80": {("cbrt", "F16"): 1195, ("log", "F16"): 321, ("log", "F32"): 259, ("log-plus-one", "F16"): 346,
              ("power", "F32"): 1221, ("sqrt", "F16"): 124, ("tanh", "F16"): 499, ("tanh", "F32"): 504},
    "sm_86": {("atan2", "F16"): 482, ("atan2", "F32"): 486, ("cbrt", "F16"): 925, ("cbrt", "F32"): 867,
              ("cosine", "F16"): 691, ("cosine", "F32"): 662, ("exponential", "F16"): 108,
              ("exponential", "F32"): 86, ("exponential-minus-one", "F16"): 396,
              ("exponential-minus-one", "F32"): 381, ("log", "F16"): 266, ("log", "F32"): 244,
              ("log-plus-one", "F16"): 284, ("log-plus-one", "F32"): 262, ("logistic", "F16"): 226,
              ("logistic", "F32"): 176, ("power", "F16"): 975, ("power", "F32"): 925, ("rsqrt", "F16"): 97,
              ("rsqrt", "F32"): 75, ("sine", "F32"): 662, ("sqrt", "F16"): 97, ("sqrt", "F32"): 75,
              ("tanh", "F16"): 212, ("tanh", "F32"): 190},
    "sm_90": {("add", "F16"): 7, ("add", "F32"): 7, ("atan2", "F16"): 451, ("atan2", "F32"): 431,
              ("cbrt", "F16"): 201, ("cbrt", "F32"): 178, ("cosine", "F16"): 997, ("cosine", "F32"): 978,
              ("divide", "F16"): 43, ("divide", "F32"): 19, ("exponential", "F16"): 102,
              ("exponential", "F32"): 79, ("exponential-minus-one", "F16"): 217,
              ("exponential-minus-one", "F32"): 190, ("log", "F16"): 182, ("log", "F32"): 166,
              ("log-plus-one", "F16"): 245, ("log-plus-one", "F32"): 229, ("multiply", "F16"): 7,
              ("multiply", "F32"): 3, ("power", "F16"): 526, ("power", "F32"): 510, ("rsqrt", "F16"): 95,
              ("rsqrt", "F32"): 75, ("sine", "F16"): 993, ("sine", "F32"): 958, ("sqrt", "F16"): 95,
              ("sqrt", "F32"): 75, ("subtract", "F16"): 7, ("subtract", "F32"): 7, ("tanh", "F16"): 502,
              ("tanh", "F32"): 467},
}
DEFAULT_PROFILE = "sm_86"        # gpu_hlo_cost_analysis.cc: FlopsPerElement's fallback
DEFAULT_FLOPS_PER_ELEMENT = 3    # kDefaultFlopsPerElement
LAUNCH_NS = 1000.0               # GpuPerformanceModelBase::kKernelLaunchOverhead
MEMORY_COMPUTE_PARALLELISM = 0.95
L2_CACHE_SPEEDUP = 2.5           # GpuPerformanceModelBase::kL2CacheSpeedup
L1_CACHE_SPEEDUP = 8.0           # GpuPerformanceModelBase::kL1CacheSpeedup
L1_CACHE_SIZE_PER_SM = 2 * 1024  # GpuPerformanceModelBase::kL1CacheSizePerSM
MEMORY_TRANSACTIONS_PER_CLOCK = 32  # DeviceDescription::memory_transactions_per_clock (CUDA)

# The HLO ops XLA:GPU emits for a jaxpr primitive are the `gpu_hlo_ops` column of
# `compiler.rules` (logistic is expanded by LogisticExpander: 1 / (1 + exp(-x))). Transcendentals
# XLA expands into branches of many ops, whose shared intermediates priority fusion fuses
# piecemeal, are stored whatever their cost (`rules.GPU_NOT_DUPLICATED`: transformer_wide_train's
# exact gelu, erfc's expansion, a select between a polynomial and an exp, is the second output of
# `loop_multiply_select_fusion` on H100 and A100 alike).
NOT_DUPLICATED = GPU_NOT_DUPLICATED
_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


@dataclass(frozen=True)
class Device:
    """The numbers of XLA's target description the performance model reads."""

    sm: str
    cores: int
    fpus_per_core: int
    clock_ghz: float
    bandwidth: float   # bytes per second
    l2_cache_size: int = 0

    def flops_per_ns(self, elements: int, blocks: int | None = None) -> float:
        """Effective FLOP rate of a loop kernel over `elements` (CalculateEffectiveFlopsPerNs:
        active cores times FPUs per core, an FMA counted twice; 128 threads a block), or of a
        kernel launched on `blocks` blocks of at least as many threads as a core's FPUs."""
        if blocks is None:
            blocks = max(1, -(-elements // 128))
        return min(blocks, self.cores) * self.fpus_per_core * self.clock_ghz * 2

    def block_bandwidth(self, rate: float, blocks: int | None) -> float:
        """`rate` limited by a launch of `blocks` blocks (gpu_performance_model_base.cc,
        AdjustBandwidth: each core issues one 32 B memory transaction a clock; an H100 needs
        about 53 busy blocks to saturate its DRAM). None: a loop kernel, taken as saturating."""
        if blocks is None:
            return rate
        return min(rate, blocks * self.clock_ghz * 1e9 * MEMORY_TRANSACTIONS_PER_CLOCK)

    def kernel_ns(self, flops: float, elements: int, nbytes: float, cached_ns: float = 0.0,
                  blocks: int | None = None) -> float:
        """One kernel's time (CombineComputeAndMemoryAccessTime); `cached_ns`: its re-reads
        (`reread_ns`); `blocks`: its launch where it is not a loop kernel's."""
        compute = flops / self.flops_per_ns(elements, blocks)
        memory = nbytes / self.block_bandwidth(self.bandwidth, blocks) * 1e9 + cached_ns
        return compute + memory - MEMORY_COMPUTE_PARALLELISM * min(compute, memory)

    def reread_ns(self, net: int, total: int, blocks: int | None = None) -> float:
        """The time of reading an operand of `net` bytes `total` bytes' worth, less its first
        read (gpu_performance_model_base.cc, ReadTimeWithDRAMHeuristic): the bytes read again
        come from the L2 cache where the operand is smaller than it, and from L1 where it is
        smaller than `L1_CACHE_SIZE_PER_SM` a core; from DRAM otherwise; no faster than a
        launch of `blocks` blocks reads (`block_bandwidth`)."""
        if total <= net:
            return 0.0
        rate = self.bandwidth
        if net < self.l2_cache_size:
            rate *= L2_CACHE_SPEEDUP
            if net < L1_CACHE_SIZE_PER_SM * self.cores:
                rate *= L1_CACHE_SPEEDUP
        return (total - net) / self.block_bandwidth(rate, blocks) * 1e9


@lru_cache(maxsize=None)
def device_numbers(device: str) -> Device | None:
    """The performance model's numbers for a jaxmem GPU preset, read from XLA's target
    description that the deviceless compile uses (None for an unknown preset)."""
    from jaxmem.errors import PlanError
    from jaxmem.xla.gpu.compile import spec_for, target_config

    spec = spec_for(device)
    if spec is None:
        return None
    try:
        text = target_config(spec)
    except PlanError:
        return None
    info = text.split("gpu_device_info", 1)[-1]

    def number(key: str) -> float:
        m = re.search(rf"\b{key}:\s*([0-9.eE+-]+)", info)
        return float(m.group(1)) if m else 0.0

    cc = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", info)
    major = re.search(r"major:\s*(\d+)", cc.group(1)) if cc else None
    minor = re.search(r"minor:\s*(\d+)", cc.group(1)) if cc else None
    sm = f"sm_{major.group(1) if major else 0}{minor.group(1) if minor else 0}"
    return Device(sm, int(number("core_count")), int(number("fpus_per_core")), number("clock_rate_ghz"),
                  number("memory_bandwidth"), int(number("l2_cache_size")))


def bf16_arithmetic_native(device: Device) -> bool:
    """Whether XLA:GPU computes bfloat16 elementwise arithmetic in bfloat16 on this device.

    Hopper (compute capability 9) has bfloat16 add and multiply; on Ampere and older XLA's
    float normalization (GpuFloatSupport) computes them in float32, converts around each op,
    and the simplifier drops the converts between two such ops: a whole bfloat16 chain runs in
    float32 and is converted back only where a reader needs bfloat16 (a GEMM). bf16_train's
    dumps: the gelu fusion is bfloat16 arithmetic on H100 and float32 on A100
    (`loop_convert_tanh_fusion`, its tanh output f32[4,256,1536]).
    """
    return int(device.sm[3:4] or 0) >= 9


def flops_per_element(device: Device, primitive: str, dtype: str, params: dict | None = None) -> int:
    """XLA's flops per element for one jaxpr elementwise op on this device (its HLO ops'
    profiled clock cycles; an `integer_pow` is its multiplies)."""
    if primitive == "integer_pow":
        y = abs(int((params or {}).get("y", 2)))
        hlo = ("multiply",) * max(1, y.bit_length() - 1 + bin(y).count("1") - 1)
    else:
        hlo = rule(primitive).gpu_hlo_ops or (primitive,)
    profile = OP_PROFILES.get(device.sm, OP_PROFILES[DEFAULT_PROFILE])
    kind = _TYPES.get(dtype, "F32")
    total = 0
    for op in hlo:
        if kind in ("BF16", "F16") and op in GPU_UPCAST_HLO_OPS:
            total += profile.get((op, "F32"), DEFAULT_FLOPS_PER_ELEMENT) + 2 * DEFAULT_FLOPS_PER_ELEMENT
        else:
            total += profile.get((op, kind), DEFAULT_FLOPS_PER_ELEMENT)
    return total


@dataclass
class Kernel:
    """A loop kernel as the model sees it: FLOPs per op (an op fused twice into one kernel is
    computed once), elements, bytes read (by value) and written."""

    flops: dict[int, float]
    elements: int
    reads: dict[int, int]
    written: int
    # operands read more than once a kernel, by key (a value, or a constant operand of an op):
    # (bytes of the operand, bytes read in all); their time is `Device.reread_ns`
    rereads: dict[Any, tuple[int, int]] = field(default_factory=dict)
    # the launch's blocks where it is not a loop kernel's (a column reduction's: `reduction`)
    blocks: int | None = None

    def cached_ns(self, device: Device, leave_out: Any = None) -> float:
        """The time of this kernel's re-reads (`leave_out`'s left out)."""
        return sum(device.reread_ns(net, total, self.blocks)
                   for k, (net, total) in self.rereads.items() if k != leave_out)

    def ns(self, device: Device) -> float:
        """This kernel's time alone."""
        return device.kernel_ns(sum(self.flops.values()), self.elements, sum(self.reads.values()) + self.written,
                                self.cached_ns(device), self.blocks)


def duplicate_is_faster(device: Device, producer: Kernel, value: int, consumers: list[Kernel]) -> bool:
    """Whether priority fusion fuses `producer` (whose output is `value`) into every consumer
    kernel: the fused kernels' time against the unfused ones' (see the module's text). A fused
    consumer reads the producer's inputs instead of `value`, an input both read counted once."""
    unfused = LAUNCH_NS * (len(consumers) + 1) + producer.ns(device)
    fused = LAUNCH_NS * len(consumers)
    for c in consumers:
        unfused += c.ns(device)
        reads = {u: b for u, b in c.reads.items() if u != value}
        reads.update(producer.reads)
        # the producer's utilization by this consumer: a consumer that broadcasts the value
        # computes the fused producer once per element it reads (EstimateRunTimeForFusion)
        times = max(1.0, c.elements / max(1, producer.elements))
        flops = {**c.flops, **{k: f * times for k, f in producer.flops.items()}}
        fused += device.kernel_ns(sum(flops.values()), max(c.elements, producer.elements),
                                  sum(reads.values()) + c.written, fused_rereads_ns(device, producer, value, c),
                                  c.blocks)
    return fused < unfused


def fused_rereads_ns(device: Device, producer: Kernel, value: int, consumer: Kernel) -> float:
    """The re-reads of `producer` fused into `consumer`: an operand both read is read, in all,
    the bytes each reads less one read of it (GetSharedOperandBytesAccessed, an elementwise
    producer's common utilization of 1)."""
    rereads = {k: r for k, r in consumer.rereads.items() if k != value}
    for k, (net, total) in producer.rereads.items():
        if k in rereads:
            rereads[k] = (net, total + rereads[k][1] - net)
        else:
            rereads[k] = (net, total)
    return sum(device.reread_ns(net, total, consumer.blocks) for net, total in rereads.values())
