"""`jaxmem.analyze` of sharded arguments: per device, as `jaxmem analyze TARGET` reports it.

From Python (and from the command line, a thin layer over it) the function is traced here over
an `AbstractMesh` and only its lowered text crosses to the compile child, which partitions it
over N compile-only devices. The truth is the other way to the same figures: the factory loaded
in a child that holds the compile-only devices itself, with JAX's own `Lowered.compile()` of
the partitioned program (`xla.sharding.sharded_reference`, itself checked against XLA's
`memory_analysis()` in tests/sharding). All three must agree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import jaxmem
from jaxmem.api.pipeline import Options, parse_device
from jaxmem.api.result import without_timings
from jaxmem.api.sharded import _pool, summarize
from jaxmem.compiler.target import load_target
from jaxmem.xla.gpu.compile import unavailable_reason as gpu_reason
from jaxmem.xla.sharding import sharded_reference
from jaxmem.xla.tpu.compile import unavailable_reason as tpu_reason

HERE = os.path.dirname(__file__)
EXAMPLES = "jaxmem.examples.sharded"
PROGRAMS = [
    pytest.param(f"{EXAMPLES}:constraint_step", "tpu-v5e-16gb", id="constraint-v5e"),
    pytest.param(f"{EXAMPLES}:dp_step", "h100-80gb", id="dp-h100", marks=pytest.mark.slow),
    pytest.param(f"{EXAMPLES}:fsdp_step", "tpu-v5e-16gb", id="fsdp-v5e", marks=pytest.mark.slow),
    pytest.param(f"{EXAMPLES}:tp_step", "a100-40gb", id="tp-a100", marks=pytest.mark.slow),
    pytest.param(f"{EXAMPLES}:shard_map_step", "h100-80gb", id="shard-map-h100", marks=pytest.mark.slow),
    pytest.param(f"{EXAMPLES}:tp_step", "tpu-v5e-16gb", id="tp-v5e", marks=pytest.mark.slow),
]


def _skip_without(device: str) -> None:
    if tpu_reason() if device.startswith("tpu") else gpu_reason():
        pytest.skip("the device's compiler is not installed here")


def cli_json(target: str, device: str, *flags: str, env: dict | None = None) -> dict:
    cmd = [sys.executable, "-m", "jaxmem", "analyze", target, "--device", device, "--json", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                         env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})))
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("target, device", PROGRAMS)
def test_sharded_analysis_is_the_target_paths_and_the_commands(target, device):
    _skip_without(device)
    fn, args = load_target(target)
    result = jaxmem.analyze(fn, *args, device=device, quiet=True)
    data = result.to_dict()
    kind = "tpu" if device.startswith("tpu") else "gpu"
    truth = sharded_reference(target, device=device, xla=kind, use_cache=False)
    capacity = parse_device(device)[1]
    expected = summarize(truth, _pool(truth, Options(device=device), capacity)[0], target=fn.__name__,
                         device=(device, capacity))
    assert without_timings(data) == without_timings(json.loads(json.dumps(expected)))
    command = cli_json(target, device)
    assert command.pop("target") == target and data.pop("target") == fn.__name__
    assert without_timings(data) == without_timings(command)
    assert result.devices == 8 and result.xla["total_bytes"] > 0 and result.fits is True
    assert result.plan["valid"] and result.peak_buffers
    # XLA's metadata names the frame that bound jaxmem's tagged copy; the rows name the user's.
    assert not any("jaxmem/compiler/" in row["source"] for row in data.get(f"xla_{kind}_peak_buffers", []))


def _mlp_args(mesh):
    w1 = jax.ShapeDtypeStruct((1024, 4096), jnp.float32, sharding=NamedSharding(mesh, P(None, "model")))
    w2 = jax.ShapeDtypeStruct((4096, 1024), jnp.float32, sharding=NamedSharding(mesh, P("model", None)))
    x = jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=NamedSharding(mesh, P("data", None)))
    return {"w1": w1, "w2": w2}, x


def _sgd(params, x):
    def loss(p):
        return jnp.mean(jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_a_jitted_steps_donation_is_read_and_an_abstract_mesh_needs_no_device():
    _skip_without("tpu-v5e-16gb")
    mesh = AbstractMesh((4, 2), ("data", "model"))
    params, x = _mlp_args(mesh)
    donated = jaxmem.analyze(jax.jit(_sgd, donate_argnums=0), params, x, device="tpu-v5e-16gb", quiet=True)
    per_device = (1024 * 4096 // 2) * 4   # each weight split in two over "model"
    assert donated.mesh == {"data": 4, "model": 2} and donated.devices == 8
    assert donated.xla["argument_bytes"] == 2 * per_device + (512 // 4) * 1024 * 4
    # Both weights are written in place of their donated buffers (undonated, XLA aliases none).
    assert donated.xla["alias_bytes"] == 2 * per_device
    with pytest.raises(jaxmem.JaxmemError, match="contradicts"):
        jaxmem.analyze(jax.jit(_sgd, donate_argnums=0), params, x, donate=(0, 1), device="tpu-v5e-16gb", quiet=True)


def test_the_result_shows_as_text_and_html():
    _skip_without("tpu-v5e-16gb")
    mesh = AbstractMesh((8,), ("data",))
    params, x = _mlp_args(AbstractMesh((4, 2), ("data", "model")))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P())), params)
    x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, P("data")))
    result = jaxmem.analyze(_sgd, params, x, device="tpu-v5e-16gb", quiet=True)
    text = str(result)
    assert "on 8 devices (data=8)" in text and "Replicated" in text
    assert {row["path"] for row in result.replicated} == {"args[0]['w1']", "args[0]['w2']"}
    html = result._repr_html_()
    assert html.startswith("<div") and "Per device" in html and "<script" not in html


BAD = {
    "an axis that does not divide": (lambda m: (jax.ShapeDtypeStruct((12, 4), jnp.float32,
                                                                     sharding=NamedSharding(m, P("data"))),),
                                     lambda x: x * 2, "not divisible by 8"),
    "an axis the function names that the mesh lacks": (
        lambda m: (jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=NamedSharding(m, P("data"))),),
        lambda x: jax.shard_map(lambda a: jax.lax.psum(a, "model"), mesh=AbstractMesh((8,), ("data",)),
                                in_specs=P("data"), out_specs=P())(x),
        "'model'"),
    "a function that fails to trace": (lambda m: (jax.ShapeDtypeStruct((16, 4), jnp.float32,
                                                                       sharding=NamedSharding(m, P("data"))),),
                                       lambda x: x @ x, "cannot trace"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_sharded_input_is_one_jaxmem_error_line(case):
    make, fn, words = BAD[case]
    _skip_without("h100-80gb")
    with pytest.raises(jaxmem.JaxmemError) as err:
        jaxmem.analyze(fn, *make(AbstractMesh((8,), ("data",))), device="h100-80gb", quiet=True)
    text = str(err.value)
    assert "\n" not in text and words in text, text


@pytest.mark.slow   # two compiles in fresh processes with 8 host devices
def test_a_mesh_of_this_hosts_devices_is_analysed_as_the_command_does():
    _skip_without("h100-80gb")
    script = textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.join(os.path.dirname(HERE), 'sharding')!r})
        import jaxmem, host_mesh
        fn, args = host_mesh.make()
        print(json.dumps(jaxmem.analyze(fn, *args, device="h100-80gb", quiet=True).to_dict()))
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    data = json.loads(out.stdout.splitlines()[-1])
    command = cli_json(f"{os.path.dirname(HERE)}/sharding/host_mesh.py:make", "h100-80gb")
    data.pop("target"), command.pop("target")
    assert without_timings(data) == without_timings(command) and data["devices"] == 8


def test_a_traced_over_an_abstract_mesh_points_to_the_function():
    _skip_without("tpu-v5e-16gb")
    mesh = AbstractMesh((8,), ("data",))
    x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    traced = jax.jit(lambda x: jnp.tanh(x) * 2).trace(x)
    with pytest.raises(jaxmem.JaxmemError) as err:
        jaxmem.analyze(traced, device="tpu-v5e-16gb", quiet=True)
    text = str(err.value)
    assert "\n" not in text and "AbstractMesh of 8 devices" in text and "jaxmem.analyze(fn, *args" in text


def test_a_pool_that_cannot_be_set_up_is_said_in_the_note(monkeypatch):
    _skip_without("h100-80gb")
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.5")
    mesh = AbstractMesh((8,), ("data",))
    x = jax.ShapeDtypeStruct((64, 512), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    result = jaxmem.analyze(lambda x: jnp.tanh(x) * 2, x, device="h100-80gb", quiet=True)
    assert result.pool is None and result.fits is None
    assert result.note.startswith("the pool is not simulated:") and "XLA_PYTHON_CLIENT_MEM_FRACTION" in result.note
    assert result.xla["total_bytes"] > 0
