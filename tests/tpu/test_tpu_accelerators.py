"""The one table of presets: GPU rows as they were, TPU rows with the memory XLA:TPU states."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from jaxmem.accelerators import ACCELERATORS, find, gpu_presets, is_gpu, resolve, tpu_presets
from jaxmem.errors import ConfigError, PlanError
from jaxmem.units import PRESETS, parse_size
from jaxmem.xla.gpu.compile import GPU_TARGETS
from jaxmem.xla.gpu.model.predict import DEVICE_SM
from jaxmem.xla.sharding import tpu_topology_for
from jaxmem.xla.tpu.compile import DEVICELESS_ENV, host_bounds, parse_topology

MiB = 1 << 20
# The three GPU tables as they stood before the one table (units.PRESETS, xla/gpu.GPU_TARGETS,
# xla.gpu.model.predict.DEVICE_SM): every GPU figure must stay byte for byte.
GPUS_BEFORE = {
    "h100-80gb": (81559, "h100_sxm", 9), "h100-94gb": (95830, "h100_sxm", 9), "h200-141gb": (143771, "h200", 9),
    "a100-40gb": (40960, "a100_sxm_40", 8), "a100-80gb": (81920, "a100_sxm_80", 8), "v100-16gb": (16384, "v100", 7),
    "v100-32gb": (32768, "v100", 7), "l4-24gb": (23034, "a6000", 8), "a10g-24gb": (23028, "a6000", 8),
    "rtx3090-24gb": (24576, "a6000", 8), "rtx4090-24gb": (24564, "a6000", 8), "t4-16gb": (15360, "v100", 7),
}


def test_gpu_rows_are_the_tables_they_replace():
    assert sorted(gpu_presets()) == sorted(GPUS_BEFORE)
    for name, (mib, spec, sm) in GPUS_BEFORE.items():
        assert PRESETS[name] == parse_size(name) == mib * MiB
        assert GPU_TARGETS[name] == spec and DEVICE_SM[name] == sm
        assert resolve(name).pool_rules == "gpu_client" and is_gpu(name)


def test_tpu_rows_have_a_topology_and_the_tpu_rules():
    assert tpu_presets() == ["tpu-v4-32gb", "tpu-v5e-16gb", "tpu-v5p-95gb", "tpu-v6e-32gb"]
    for name in tpu_presets():
        acc = resolve(name)
        assert acc.is_tpu and not is_gpu(name) and acc.pool_rules == "tpu_runtime"
        assert PRESETS[name] == acc.capacity_bytes
        parse_topology(acc.topology)
    # The chip's own figure, read from memory_stats() on a v5e (benchmarks/results/tpu_v5e_chip.jsonl).
    assert resolve("tpu-v5e-16gb").capacity_bytes == 16_909_336_064


def test_unknown_presets_and_topologies_are_one_line():
    with pytest.raises(ConfigError, match="unknown device 'tpu-v9'.*tpu-v5e-16gb"):
        resolve("tpu-v9")
    assert find("24GiB") is None and resolve(" TPU-V5E-16GB ").name == "tpu-v5e-16gb"
    for bad in ("v5e", "v5e:abc", "v5e:2x", "5e:2x4", "v5e:2x4x1x1"):
        with pytest.raises(PlanError, match="unknown TPU topology"):
            parse_topology(bad)


def test_slices_grow_to_hold_the_mesh():
    assert [tpu_topology_for("tpu-v5e-16gb", n) for n in (1, 2, 4, 8, 16, 32)] == \
        ["v5e:1x1", "v5e:1x2", "v5e:2x2", "v5e:2x4", "v5e:4x4", "v5e:4x8"]
    assert tpu_topology_for("tpu-v5p-95gb", 8) == "v5p:2x2x2"
    assert host_bounds((2, 4)) == (2, 4, 1) and host_bounds((4, 8)) == (2, 4, 1) and host_bounds((2, 2, 2)) == (2, 2, 1)


STATED = re.compile(r"exceeds available HBM \(([0-9.]+)G\)")


@pytest.mark.usefixtures("needs_libtpu")
def test_capacities_are_what_xla_tpu_states():
    """Each TPU preset's capacity is XLA:TPU's own limit for its topology, as its out-of-memory
    message states it (two decimals of GiB), from a deviceless compile of a 32 GiB program."""
    script = (
        "import numpy as np, jax, jax.numpy as jnp\n"
        "from jax.sharding import Mesh, NamedSharding, PartitionSpec as P\n"
        "from jaxmem.accelerators import tpu_presets, resolve\n"
        "from jaxmem.xla.tpu.compile import topology_devices\n"
        "for name in tpu_presets():\n"
        "    d = topology_devices(resolve(name).topology)[:1]\n"
        "    s = NamedSharding(Mesh(np.array(d), ('x',)), P())\n"
        "    x = jax.ShapeDtypeStruct((128 * 1024, 256 * 1024), jnp.float32, sharding=s)\n"
        "    try:\n"
        "        jax.jit(lambda a: a * 2).trace(x).lower().compile()\n"
        "        print(name, 'compiled')\n"
        "    except Exception as e:\n"
        "        print(name, ' '.join(str(e).split()))\n"
    )
    env = {**__import__("os").environ, "JAX_PLATFORMS": "cpu", **DEVICELESS_ENV}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600).stdout
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("tpu-")}
    assert sorted(lines) == tpu_presets(), out
    for name, line in lines.items():
        stated = STATED.search(line)
        assert stated, line
        assert round(resolve(name).capacity_bytes / 2 ** 30, 2) == float(stated.group(1)), line
