"""`jaxmem.maxbatch` of a factory sharded over a mesh: the largest global batch whose per-device
program fits every chip, in steps of what the mesh needs. The truth is JAX's own AOT compile of
the step at that batch and the next one, on compile-only v5e chips in a child (not jaxmem's
lowering, cache or child): XLA:TPU's per-chip total with its code within the chip, or its
refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import jaxmem
from jaxmem.api.maxbatch_mesh import batch_multiple, mesh_of

HERE = os.path.dirname(os.path.abspath(__file__))

TRUTH = """
import json, sys
import numpy as np
import jax
from jax.experimental import topologies
from jax.sharding import Mesh
sys.path.insert(0, {here!r})
import mesh_steps
topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4", chips_per_host_bounds=(2, 2, 1))
mesh = Mesh(np.array(topology.devices[:8]), ("data",))
out = {{}}
for batch in {batches!r}:
    try:
        compiled = jax.jit(mesh_steps.step, donate_argnums=0).lower(*mesh_steps.structs(batch, mesh)).compile()
    except Exception as err:
        out[batch] = {{"refused": "RESOURCE_EXHAUSTED" in str(err)}}
        continue
    m = compiled.memory_analysis()
    out[batch] = {{"total": m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - m.alias_size_in_bytes, "code": m.generated_code_size_in_bytes}}
print(json.dumps(out))
"""


def _xla_tpu_here() -> None:
    from jaxmem.xla.tpu.compile import unavailable_reason

    if unavailable_reason():
        pytest.skip("XLA:TPU's deviceless compiler is not installed here")


def _truth(batches: list[int]) -> dict[int, dict]:
    from jaxmem.xla.tpu.compile import DEVICELESS_ENV

    env = dict(os.environ, **DEVICELESS_ENV, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", TRUTH.format(here=HERE, batches=batches)], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def _abstract(sizes, names, specs):
    mesh = AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(sizes))

    def make(batch_size):
        def sds(shape, spec):
            return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))
        args = (sds((batch_size, 16), specs[0]), sds((2 * batch_size, 8), specs[1]), sds((64, 32), specs[2]))
        return (lambda a, b, c: (a.sum() + b.sum()) * c), args

    return make


def test_the_step_is_what_the_sharded_dimensions_the_value_sizes_need():
    # data=4, model=2: x's batch over data needs 4; y's dimension is twice the batch, over
    # (data, model): 8 parts of 2 per unit, so 4; w is not sized by the batch.
    make = _abstract((4, 2), ("data", "model"), (P("data"), P(("data", "model")), P("model")))
    sizes, shardings = mesh_of(make, "batch_size", 8)
    assert sizes == {"data": 4, "model": 2}
    assert batch_multiple(make, "batch_size", sizes, shardings) == 4
    # The batch over both axes (8 parts): 8.
    make = _abstract((4, 2), ("data", "model"), (P(("data", "model")), P(None), P(None)))
    assert batch_multiple(make, "batch_size", *mesh_of(make, "batch_size", 8)) == 8
    # Nothing the batch sizes is sharded: every value lays out.
    make = _abstract((4, 2), ("data", "model"), (P(None), P(None), P("model")))
    assert batch_multiple(make, "batch_size", *mesh_of(make, "batch_size", 8)) == 1


@pytest.mark.slow   # 7 per-chip XLA:TPU compiles, then two of JAX's own: about 4 minutes on 2 cores
def test_maxbatch_on_a_mesh_is_the_largest_batch_xla_fits_on_every_chip():
    _xla_tpu_here()
    sys.path.insert(0, HERE)
    import mesh_steps

    result = jaxmem.maxbatch(mesh_steps.make, arg="batch_size", device="tpu-v5e-16gb", quiet=True)
    assert result.devices == 8 and result.mesh == {"data": 8} and result.multiple == 8
    assert result.value % 8 == 0 and not result.at_maximum
    truth = _truth([result.value, result.value + 8])
    limit = result.limit_bytes
    here, above = truth[result.value], truth[result.value + 8]
    assert "total" in here and here["total"] + here["code"] <= limit
    assert here["total"] == result.total_bytes
    assert above.get("refused") or above["total"] + above["code"] > limit
    assert "per-device total" in str(result) and "steps of 8" in str(result)


def test_a_mesh_where_even_the_least_batch_does_not_fit_says_so_in_the_value_searched():
    _xla_tpu_here()
    sys.path.insert(0, HERE)
    import mesh_steps

    with pytest.raises(jaxmem.JaxmemError) as err:
        jaxmem.maxbatch(mesh_steps.make, arg="batch_size", device="tpu-v5e-16gb", lo=1024, quiet=True)
    line = str(err.value)
    assert "even batch_size=1024" in line and "steps of 8" in line and "jaxmem fit" in line
    assert "\n" not in line
