"""`jaxmem.fit` of a step sharded over a mesh: the cheapest change that fits each device, as code
to paste. The truth for the answer is JAX's own AOT compile (not jaxmem's lowering, cache or
child) of the step with the printed line pasted into its source, on compile-only v5e chips."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import jaxmem
from jaxmem.errors import ConfigError
from jaxmem.fitting.layout_code import layout_code
from jaxmem.xla.sharding import LAYOUTS, layout_specs

API = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "api")

TRUTH = """
import importlib.util, json, sys
import numpy as np
import jax
from jax.experimental import topologies
from jax.sharding import Mesh
topology = topologies.get_topology_desc(platform="tpu", topology_name="v5e:2x4", chips_per_host_bounds=(2, 2, 1))
mesh = Mesh(np.array(topology.devices[:8]), ("data",))
out = {{}}
for name, path in {paths!r}.items():
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        compiled = jax.jit(getattr(module, {step!r}), donate_argnums=0).lower(*module.structs({batch}, mesh)).compile()
    except Exception as err:
        out[name] = {{"refused": "RESOURCE_EXHAUSTED" in str(err)}}
        continue
    m = compiled.memory_analysis()
    out[name] = {{"total": m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                 - m.alias_size_in_bytes, "code": m.generated_code_size_in_bytes}}
print(json.dumps(out))
"""


def _tree():
    mesh = AbstractMesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
    state = {"w": jnp.zeros((6, 16, 8)), "b": jnp.zeros((12,)), "step": jnp.zeros(()), "odd": jnp.zeros((3, 5))}
    return mesh, state, jnp.zeros((32, 7))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_printed_layout_code_lays_out_what_jaxmem_compiled(layout):
    mesh, state, batch = _tree()
    sizes = {"data": 4, "model": 2} if layout == "fsdp_tp" else {"data": 8}
    code = layout_code(layout, sizes)
    assert f"jax.make_mesh({tuple(sizes.values())!r}, {tuple(sizes)!r})" in code
    # Run the printed code with the mesh it makes (an abstract one of the same axes: no devices here).
    body = "\n".join(line for line in code.splitlines() if not line.startswith(("mesh =", "state =", "batch =")))
    abstract = AbstractMesh(tuple(sizes.values()), tuple(sizes), axis_types=(AxisType.Auto,) * len(sizes))
    scope: dict = {"mesh": abstract}
    exec(body, scope)
    got = [tuple(scope["state_sharding"](x).spec) for x in jax.tree.leaves(state)]
    got += [tuple(scope["batch_sharding"](x).spec) for x in jax.tree.leaves(batch)]
    want = [tuple(s) for s in layout_specs((state, batch), layout, sizes)]
    assert [tuple(P(*g)) for g in got] == [tuple(P(*w)) for w in want]
    del mesh


def test_a_mesh_step_without_a_device_is_one_line():
    mesh = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    x = jax.ShapeDtypeStruct((64, 32), jnp.float32, sharding=NamedSharding(mesh, P("data")))
    with pytest.raises(ConfigError, match="sharded over a mesh: give the device"):
        jaxmem.fit(lambda x: x * 2, x, budget="1GiB")


def jax_aot_on_v5e(paths: dict[str, str], step: str, batch: int = 160) -> dict:
    """JAX's own AOT compile, on v5e:2x4's compile-only chips, of `step` in each file of `paths`
    (in a child: deviceless XLA:TPU): {name: {"total", "code"} or {"refused"}}."""
    from jaxmem.xla.tpu.compile import DEVICELESS_ENV

    env = dict(os.environ, **DEVICELESS_ENV, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", TRUTH.format(paths=paths, batch=batch, step=step)], env=env,
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _paste(printed: str, source: str) -> str:
    """mesh_steps.py with fit's printed `jax.lax.scan(...)` line pasted where the scan is."""
    m = re.search(r"jax\.lax\.scan\((jax\.checkpoint\(layer, policy=[^)]*\)+?), \.\.\.\)", printed)
    assert m, printed
    assert "jax.lax.scan(layer, x," in source
    return source.replace("jax.lax.scan(layer, x,", f"jax.lax.scan({m.group(1)}, x,")


@pytest.mark.slow   # about 12 per-chip XLA:TPU compiles, then two of JAX's own: about 2 minutes on 2 cores
def test_fit_on_a_mesh_answers_with_code_that_compiles_within_each_chip(tmp_path):
    from jaxmem.xla.tpu.compile import unavailable_reason

    if unavailable_reason():
        pytest.skip("XLA:TPU's deviceless compiler is not installed here")
    sys.path.insert(0, API)
    import mesh_steps

    fn, args = mesh_steps.make(160)
    result = jaxmem.fit(fn, *args, budget="tpu-v5e-16gb", device="tpu-v5e-16gb")
    assert result.mesh == {"data": 8} and not result.before.fits and result.best is not None
    assert result.best.policy is not None and result.best.total_bytes <= result.budget_bytes
    assert result.best.collective_bytes and result.compiles + result.cached >= 2
    text = result.text()
    assert "answer:" in text and "per device" in text
    source = open(os.path.join(API, "mesh_steps.py")).read()
    pasted = tmp_path / "pasted.py"
    pasted.write_text(_paste(result.best.code, source))
    truth = jax_aot_on_v5e({"written": os.path.join(API, "mesh_steps.py"), "pasted": str(pasted)}, "step")
    assert truth["written"].get("refused") or truth["written"]["total"] > result.budget_bytes
    assert truth["pasted"]["total"] == result.best.total_bytes
    assert truth["pasted"]["total"] + truth["pasted"]["code"] <= result.budget_bytes


def test_the_command_asks_for_the_device_of_a_mesh_factory_in_one_line(capsys):
    from jaxmem.cli.main import main as cli_main

    target = os.path.join(API, "mesh_steps.py") + ":make160"
    assert cli_main(["fit", target, "--budget", "15GiB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give --device" in err[0]


@pytest.mark.slow   # the same compiles as the test above (from the cache when it ran first)
def test_the_command_prints_the_answer_and_its_json(capsys):
    from jaxmem.xla.tpu.compile import unavailable_reason

    if unavailable_reason():
        pytest.skip("XLA:TPU's deviceless compiler is not installed here")
    from jaxmem.cli.main import main as cli_main

    target = os.path.join(API, "mesh_steps.py") + ":make160"
    assert cli_main(["fit", target, "--budget", "tpu-v5e-16gb", "--device", "tpu-v5e-16gb", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["devices"] == 8 and data["answer"]["fits"]
    assert data["answer"]["xla_total_bytes_per_device"] <= data["budget_bytes"] < data["before"]["xla_total_bytes_per_device"]
    assert data["answer"]["collective_bytes_per_device"] > 0
    assert {c["layout"] for c in data["candidates"]} >= {"dp", "fsdp", "fsdp_tp"}


def test_a_refusal_is_cached_and_a_tampered_one_is_compiled_again(tmp_path, monkeypatch):
    from jaxmem.fitting.mesh import MeshJudge
    from jaxmem.xla.tpu.compile import unavailable_reason

    if unavailable_reason():
        pytest.skip("XLA:TPU's deviceless compiler is not installed here")
    monkeypatch.setenv("JAXMEM_CACHE_DIR", str(tmp_path))
    sys.path.insert(0, API)
    import mesh_steps

    _, args = mesh_steps.make(1024)   # 8x what fits a chip: XLA:TPU refuses it
    judge = MeshJudge("tpu-v5e-16gb")
    first = judge.compiled(mesh_steps.step, args, (0,))
    again = judge.compiled(mesh_steps.step, args, (0,))
    assert first.refused and not first.cached and again.cached and again.refused == first.refused
    assert (judge.compiles, judge.cached) == (1, 1)
    assert again.figures.total == first.figures.total > judge.accelerator.capacity_bytes
    # A cache file is untrusted: one that is not a refusal of this program is not believed.
    (entry,) = tmp_path.glob("*-refused.json")
    entry.write_text(json.dumps({"key": "another program", "refused": "does not fit"}))
    third = judge.compiled(mesh_steps.step, args, (0,))
    assert third.refused and not third.cached and judge.compiles == 2
