"""A mesh of GPUs beyond one node: 64 H100s as 8 nodes of 8, analysed per device. The truth is
JAX's own AOT compile of the same step on the CUDA plugin's 64 compile-only GPUs in a child
(`Lowered.compile().memory_analysis()`), not jaxmem's lowering, cache or compile child."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import AbstractMesh, AxisType

import jaxmem

HERE = os.path.dirname(os.path.abspath(__file__))

TRUTH = """
import json, sys
import numpy as np
import jax
from jax.experimental import topologies
from jax.sharding import Mesh
from jaxmem.xla import compilers
compilers.activate()
from jaxmem.units import PRESETS
from jaxmem.xla.gpu.compile import spec_for, target_config, with_memory
sys.path.insert(0, {here!r})
import gpu_nodes_step as s
text = with_memory(target_config(spec_for("h100-80gb")), PRESETS["h100-80gb"])
topology = topologies.get_topology_desc(platform="cuda", target_config=text, topology="8x1x8")
mesh = Mesh(np.array(topology.devices).reshape(8, 8), ("data", "model"))
m = jax.jit(s.step, donate_argnums=0).lower(*s.structs(mesh)).compile().memory_analysis()
print(json.dumps({{"argument_bytes": m.argument_size_in_bytes, "output_bytes": m.output_size_in_bytes,
                  "temp_bytes": m.temp_size_in_bytes, "alias_bytes": m.alias_size_in_bytes}}))
"""


def test_64_gpus_in_8_nodes_are_analysed_per_device_as_jax_compiles_them():
    from jaxmem.xla.gpu.compile import unavailable_reason

    if unavailable_reason():
        pytest.skip("XLA:GPU's deviceless compiler is not installed here")
    sys.path.insert(0, HERE)
    import gpu_nodes_step as s

    mesh = AbstractMesh((8, 8), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    result = jaxmem.analyze(jax.jit(s.step, donate_argnums=0), *s.structs(mesh), device="h100-80gb", quiet=True)
    assert result.devices == 64 and result.mesh == {"data": 8, "model": 8}
    out = subprocess.run([sys.executable, "-c", TRUTH.format(here=HERE)], env=dict(os.environ, JAX_PLATFORMS="cpu"),
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    truth = json.loads(out.stdout.strip().splitlines()[-1])
    assert {k: result.xla[k] for k in truth} == truth
    assert result.fits is True
