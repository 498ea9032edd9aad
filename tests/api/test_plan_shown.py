"""jaxmem's own plan beside XLA's figure for the device: shown where it is near XLA's, withheld
with one line where it is far above (it would list buffers the compiled program never holds).

The truth is XLA's own compile for the device (its `memory_analysis()` per device, deviceless)
and jaxmem's plan made on its own (`jaxmem.plan`): the rule is held to the ratio of the two,
and no table of the analysis may list a buffer larger than XLA's total for the device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

import jaxmem
from jaxmem.reports.plan_check import SHOWN_WITHIN
from jaxmem.xla.gpu.compile import unavailable_reason as gpu_reason
from jaxmem.xla.tpu.compile import unavailable_reason as tpu_reason

LAYERS, D, F = 16, 1024, 4096


def _needs(device: str) -> None:
    if tpu_reason() if device.startswith("tpu") else gpu_reason():
        pytest.skip("the device's compiler is not installed here")


def scanned_step(params, x):
    def loss(p, x):
        def layer(h, w):
            return h + jax.nn.gelu(h @ w[0]) @ w[1], None
        h, _ = jax.lax.scan(jax.checkpoint(layer), x, (p["w1"], p["w2"]))
        return jnp.mean(h.astype(jnp.float32) ** 2)

    grads = jax.grad(loss)(params, x)
    return jax.tree.map(lambda a, b: a - 1e-3 * b, params, grads)


def _scanned_args(batch: int, mesh=None):
    def sds(shape, spec):
        sharding = None if mesh is None else NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding)

    params = {"w1": sds((LAYERS, D, F), P(None, "data", None)), "w2": sds((LAYERS, F, D), P(None, "data", None))}
    return params, sds((batch, 512, D), P("data", None, None))


def _suite(name: str) -> tuple:
    """A suite program's function, its arguments and its donation, in that order."""
    from jaxmem.examples.suite import PROGRAMS

    program = PROGRAMS[name]
    fn, args = program.factory()
    return (fn, *args, program.donate_argnums)


def test_a_plan_far_above_the_devices_figure_is_withheld():
    # The suite's donated MLP step on a v5e: XLA:TPU updates the donated state in place in
    # fusions; jaxmem's unfused plan holds new parameters and moments beside the old.
    _needs("tpu-v5e-16gb")
    fn, *args, donate = _suite("mlp_train_donated")
    result = jaxmem.analyze(fn, *args, donate=donate, device="tpu-v5e-16gb", quiet=True)
    plan = jaxmem.plan(fn, *args, donate_argnums=donate, xla=False)
    data = result.to_dict()
    ratio = plan.peak_bytes / result.xla["total_bytes"]
    assert ratio > SHOWN_WITHIN
    assert data["peak_bytes"] is None and data["top_buffers"] == []
    assert data["plan_withheld"]["peak_bytes"] == plan.peak_bytes
    text = result.text(width=200)
    assert "jaxmem peak" not in text and f"{ratio:.2f}x XLA:TPU's total" in text
    assert result.fits is True   # the pool's verdict on XLA's buffers stands
    assert result.peak_buffers == data["xla_tpu_peak_buffers"]
    assert all(row["size_bytes"] <= result.xla["total_bytes"] for row in result.peak_buffers)


def test_a_plan_near_the_devices_figure_is_shown_after_it():
    _needs("h100-80gb")
    params, x = _scanned_args(batch=4)
    result = jaxmem.analyze(jax.jit(scanned_step), params, x, device="h100-80gb", quiet=True)
    plan = jaxmem.plan(jax.jit(scanned_step), params, x)
    ratio = plan.peak_bytes / result.xla["total_bytes"]
    assert 1 / SHOWN_WITHIN <= ratio <= SHOWN_WITHIN
    data = result.to_dict()
    assert data["peak_bytes"] == plan.peak_bytes and "plan_withheld" not in data
    text = result.text(width=200)
    assert text.index("XLA:GPU h100-80gb") < text.index("jaxmem peak")
    html = result.html()
    assert html.index("XLA:GPU h100-80gb") < html.index("jaxmem plan (peak)")


def test_a_per_device_plan_far_above_xlas_is_withheld_on_a_mesh():
    # Scanned layers under FSDP on 8 chips: jaxmem's per-device plan keeps the loop body at its
    # global shapes (whole stacked weights gathered), which the partitioned program never holds.
    _needs("tpu-v5e-16gb")
    mesh = AbstractMesh((8,), ("data",), axis_types=(AxisType.Auto,))
    params, x = _scanned_args(batch=16, mesh=mesh)
    result = jaxmem.analyze(jax.jit(scanned_step), params, x, device="tpu-v5e-16gb", quiet=True)
    per_device = result.xla["total_bytes"]
    assert result.plan["withheld_peak_bytes"] / per_device > SHOWN_WITHIN
    assert result.to_dict()["peak_bytes"] is None and result.plan["top"] == []
    text = result.text(width=200)
    assert "not shown" in text and "XLA:TPU's per-device total" in text
    assert "jaxmem's per-device peak" not in text
    assert result.peak_buffers and all(row["size_bytes"] <= per_device for row in result.peak_buffers)
    assert str(LAYERS * D * F // 8) not in text and f"{LAYERS},{D},{F}" not in text.replace(" ", "")


def test_the_plans_report_files_say_how_far_it_is_from_the_device(tmp_path):
    # `--html` draws jaxmem's plan by request; where the tables withhold it, the page says so.
    from jaxmem.cli.main import main as cli_main

    _needs("tpu-v5e-16gb")
    page = tmp_path / "report.html"
    code = cli_main(["analyze", "jaxmem.examples.suite:mlp_train", "--donate", "0,1", "--device", "tpu-v5e-16gb",
                     "--html", str(page)])
    assert code == 0
    fn, *args, donate = _suite("mlp_train_donated")
    data = jaxmem.analyze(fn, *args, donate=donate, device="tpu-v5e-16gb", quiet=True).to_dict()
    expected = f"{data['plan_withheld']['ratio_to_xla']:.2f}x XLA:TPU's total: this timeline is jaxmem's unfused plan"
    assert expected in page.read_text()
