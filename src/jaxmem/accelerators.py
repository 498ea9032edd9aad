"""What jaxmem knows of each accelerator preset, in one table: its platform, its memory as its
runtime reports it, the XLA target a deviceless compile uses, and the runtime's memory rules.

Every command resolves `--device` once (`resolve`) and passes the `Accelerator` on: a new chip
is a new row here, not a new code path.

    acc = resolve("tpu-v5e-16gb")
    acc.platform, acc.capacity_bytes, acc.topology     # ('tpu', 16909336064, 'v5e:1x1')
    resolve("h100-80gb").gpu_spec                      # 'h100_sxm'

The memory rules (`pool_rules`) say how the runtime holds a program's memory:
- "gpu_client": JAX's GPU client. A BFC pool, 75% of the device preallocated by default, set up
  from `XLA_PYTHON_CLIENT_PREALLOCATE`, `XLA_CLIENT_MEM_FRACTION` (or its older name
  `XLA_PYTHON_CLIENT_MEM_FRACTION`) and `XLA_PYTHON_CLIENT_ALLOCATOR`; arguments, outputs and the
  program's one temp allocation all come from the pool.
- "tpu_runtime": JAX's TPU runtime. No preallocation and none of the `XLA_PYTHON_CLIENT_*`
  variables (they are the GPU client's): arguments and outputs are buffers up to the chip's
  limit, the program's temporaries are a reservation of its own, and the program's code lives
  in HBM beside them (see `runtime/tpu_pool.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxmem.errors import ConfigError

_MiB, _GiB = 1 << 20, 1 << 30


@dataclass(frozen=True)
class Accelerator:
    """One resolved device preset.

    Attributes:
        name: the preset (`h100-80gb`, `tpu-v5e-16gb`).
        platform: "gpu" or "tpu".
        capacity_bytes: device memory as its runtime reports it (GPU: `nvidia-smi`'s memory.total;
            TPU: `memory_stats()["bytes_limit"]` where read on a chip, else XLA:TPU's own limit).
        gpu_spec: XLA's GPU target description (`xla/gpu/targets/<spec>.txtpb`), GPUs only.
        compute_capability: the GPU's major compute capability (XLA:GPU's choices read it).
        topology: the TPU topology a deviceless compile builds for one chip (`v5e:1x1`).
        pool_rules: "gpu_client" or "tpu_runtime" (module docstring).
        capacity_source: where `capacity_bytes` comes from, for people.
    """

    name: str
    platform: str
    capacity_bytes: int
    gpu_spec: str | None = None
    compute_capability: int | None = None
    topology: str | None = None
    pool_rules: str = "gpu_client"
    capacity_source: str = ""

    @property
    def is_gpu(self) -> bool:
        return self.platform == "gpu"

    @property
    def is_tpu(self) -> bool:
        return self.platform == "tpu"

    @property
    def xla_name(self) -> str:
        """How reports name its compiler: "XLA:GPU" or "XLA:TPU"."""
        return f"XLA:{self.platform.upper()}"

    @property
    def tpu_version(self) -> str | None:
        """The topology's chip name (`v5e`), TPUs only."""
        return self.topology.split(":", 1)[0] if self.topology else None


def _gpu(name: str, mib: int, spec: str, sm: int) -> Accelerator:
    return Accelerator(name, "gpu", mib * _MiB, gpu_spec=spec, compute_capability=sm,
                       capacity_source="nvidia-smi memory.total")


def _tpu(name: str, nbytes: int, topology: str, source: str) -> Accelerator:
    return Accelerator(name, "tpu", nbytes, topology=topology, pool_rules="tpu_runtime", capacity_source=source)


# GPU capacity: the driver's memory.total (an H100 80GB reports 81559 MiB). The spec is XLA's
# target description for the part, or the nearest one XLA ships (named in the comment).
# TPU capacity: what the chip's runtime gives a program. v5e: `bytes_limit` read on a v5e
# (benchmarks/results/tpu_v5e_chip.jsonl); the others: the limit XLA:TPU's compile states in
# its out-of-memory message ("exceeds available HBM (31.25G)"), no chip having been read.
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    _gpu("h100-80gb", 81559, "h100_sxm", 9),
    _gpu("h100-94gb", 95830, "h100_sxm", 9),      # H100 NVL / SXM 94 GB: the SXM part's 132 SMs
    _gpu("h200-141gb", 143771, "h200", 9),
    _gpu("a100-40gb", 40960, "a100_sxm_40", 8),
    _gpu("a100-80gb", 81920, "a100_sxm_80", 8),
    _gpu("v100-16gb", 16384, "v100", 7),
    _gpu("v100-32gb", 32768, "v100", 7),
    _gpu("l4-24gb", 23034, "a6000", 8),           # sm_89: no Ada description; RTX A6000 (sm_86) is nearest
    _gpu("a10g-24gb", 23028, "a6000", 8),         # sm_86
    _gpu("rtx3090-24gb", 24576, "a6000", 8),      # sm_86
    _gpu("rtx4090-24gb", 24564, "a6000", 8),      # sm_89: as l4
    _gpu("t4-16gb", 15360, "v100", 7),            # sm_75: XLA ships no Turing description; V100 (sm_70) is nearest
    # v4's deviceless topology has one device per TensorCore (two per chip, 15.25 GiB each as
    # XLA:TPU states it); JAX on a v4 runs both cores as one device, which a deviceless compile
    # cannot build, so this preset compiles for one core and says so.
    _tpu("tpu-v4-32gb", int(15.25 * _GiB), "v4:1x1x1", "XLA:TPU's limit for one v4 TensorCore"),
    _tpu("tpu-v5e-16gb", 16_909_336_064, "v5e:1x1", "memory_stats()['bytes_limit'] on a v5e"),
    _tpu("tpu-v5p-95gb", int(95.74 * _GiB), "v5p:1x1x1", "XLA:TPU's stated limit"),
    _tpu("tpu-v6e-32gb", int(31.25 * _GiB), "v6e:1x1", "XLA:TPU's stated limit"),
)}


# What JAX's `device.device_kind` says for each preset's chip ("TPU v5 lite" is a v5e), and, for a
# part sold in two sizes, the memory that tells them apart (the larger preset at or above it).
_KINDS: tuple[tuple[str, str, tuple[tuple[int, str], ...]], ...] = (
    ("tpu", "tpu v5 lite", ((0, "tpu-v5e-16gb"),)),
    ("tpu", "tpu v5e", ((0, "tpu-v5e-16gb"),)),
    ("tpu", "tpu v6 lite", ((0, "tpu-v6e-32gb"),)),
    ("tpu", "tpu v6e", ((0, "tpu-v6e-32gb"),)),
    ("tpu", "tpu v5p", ((0, "tpu-v5p-95gb"),)),
    ("tpu", "tpu v5", ((0, "tpu-v5p-95gb"),)),
    ("tpu", "tpu v4", ((0, "tpu-v4-32gb"),)),
    ("gpu", "h200", ((0, "h200-141gb"),)),
    ("gpu", "h100", ((0, "h100-80gb"), (88 * _GiB, "h100-94gb"))),
    ("gpu", "a100", ((0, "a100-40gb"), (60 * _GiB, "a100-80gb"))),
    ("gpu", "v100", ((0, "v100-16gb"), (24 * _GiB, "v100-32gb"))),
    ("gpu", "a10g", ((0, "a10g-24gb"),)),
    ("gpu", "l4", ((0, "l4-24gb"),)),
    ("gpu", "rtx 3090", ((0, "rtx3090-24gb"),)),
    ("gpu", "rtx 4090", ((0, "rtx4090-24gb"),)),
    ("gpu", "t4", ((0, "t4-16gb"),)),
)


def for_device(platform: str, device_kind: str, memory_bytes: int | None = None) -> Accelerator | None:
    """The preset of a device JAX reports (`device.platform`, `device.device_kind` and, for a
    part made in two sizes, its memory), or None where jaxmem has none.

    >>> for_device("tpu", "TPU v5 lite").name, for_device("gpu", "NVIDIA A100-SXM4-80GB", 85 << 30).name
    ('tpu-v5e-16gb', 'a100-80gb')
    >>> for_device("gpu", "NVIDIA B200") is None
    True
    """
    platform = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    tokens = device_kind.lower().replace("-", " ").split()
    for where, name, sizes in _KINDS:
        want = name.split()
        if where != platform or not any(tokens[i:i + len(want)] == want for i in range(len(tokens))):
            continue
        chosen = sizes[0][1]
        for floor, preset in sizes:
            if memory_bytes is not None and memory_bytes >= floor:
                chosen = preset
        return ACCELERATORS[chosen]
    return None


def resolve(name: str) -> Accelerator:
    """The preset `name` (any case, surrounding spaces ignored).

    >>> resolve(" H100-80GB ").gpu_spec, resolve("tpu-v5e-16gb").topology
    ('h100_sxm', 'v5e:1x1')

    Raises:
        ConfigError: not a preset (the message lists them).
    """
    found = find(name)
    if found is None:
        raise ConfigError(f"unknown device {name!r}: use a preset ({', '.join(sorted(ACCELERATORS))})")
    return found


def find(name: str) -> Accelerator | None:
    """The preset `name`, or None (a size such as `24GiB` is not a preset)."""
    return ACCELERATORS.get(str(name).strip().lower())


def is_gpu(name: str | None) -> bool:
    """Whether `name` is a GPU preset (None, a size or a TPU preset: False).

    >>> is_gpu("a100-40gb"), is_gpu("tpu-v5e-16gb"), is_gpu(None)
    (True, False, False)
    """
    found = find(name) if name else None
    return found is not None and found.is_gpu


def gpu_presets() -> list[str]:
    """The GPU presets, sorted (what `--device` may name where XLA:GPU judges)."""
    return sorted(a.name for a in ACCELERATORS.values() if a.is_gpu)


def tpu_presets() -> list[str]:
    """The TPU presets, sorted."""
    return sorted(a.name for a in ACCELERATORS.values() if a.is_tpu)


def capacities() -> dict[str, int]:
    """Preset -> capacity in bytes (`units.PRESETS`)."""
    return {a.name: a.capacity_bytes for a in ACCELERATORS.values()}
