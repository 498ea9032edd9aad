"""What `jaxmem.analyze` takes: plain, jitted, Traced and Lowered functions, donation read from
the jit (per leaf), pytrees of every kind; and every bad input as one `JaxmemError` line."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.api.result import without_timings
from jaxmem.xla.tpu.compile import unavailable_reason as tpu_reason

from api_programs import sgd_step, weights

DEVICE = "tpu-v5e-16gb"
needs_tpu = pytest.mark.skipif(tpu_reason() is not None, reason="libtpu is not installed here")
X = jax.ShapeDtypeStruct((32, 256), jnp.float32)


@needs_tpu
def test_jitted_donation_gives_the_figures_of_donate_0_1():
    def step(w, v, x):
        return sgd_step(w, x), jax.tree.map(lambda a: 0.9 * a, v)

    plain = jaxmem.analyze(step, weights(), weights(), X, device=DEVICE, donate=(0, 1), quiet=True)
    jitted = jaxmem.analyze(jax.jit(step, donate_argnums=(0, 1)), weights(), weights(), X, device=DEVICE, quiet=True)
    assert without_timings(jitted.xla) == without_timings(plain.xla) and jitted.xla["alias_bytes"] > 0
    assert jitted.plan.donated == plain.plan.donated and jitted.plan.peak_bytes == plain.plan.peak_bytes
    traced = jax.jit(step, donate_argnums=(0, 1)).trace(weights(), weights(), X)
    assert without_timings(jaxmem.analyze(traced, device=DEVICE, quiet=True).xla) == without_timings(plain.xla)


@needs_tpu
def test_donation_is_read_per_leaf_and_keywords_are_the_functions():
    def step(w, x, *, scale):
        return jax.tree.map(lambda a: a * scale, w), x.sum()

    jitted = jax.jit(step, donate_argnames=("w",))
    result = jaxmem.analyze(jitted, weights(), X, kwargs={"scale": 2.0}, device=DEVICE, quiet=True)
    assert list(result.plan.donated) == [0, 1]
    assert result.xla["alias_bytes"] == 2 * 256 * 1024 * 4


def test_a_donate_that_contradicts_the_jit_is_one_line():
    jitted = jax.jit(sgd_step, donate_argnums=0)
    with pytest.raises(jaxmem.JaxmemError) as err:
        jaxmem.analyze(jitted, weights(), X, donate=(0, 1), device=DEVICE, quiet=True)
    assert "contradicts" in str(err.value) and "\n" not in str(err.value)


def _host_sharded(fn, devices):
    mesh = jax.sharding.Mesh(devices, ("x",))
    return jax.jit(fn, in_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


@needs_tpu
def test_in_shardings_on_one_host_device_is_the_same_program_on_the_device():
    # One device anywhere is the same program: XLA:TPU's figures equal those of the plain jit.
    placed = jaxmem.analyze(_host_sharded(sgd_step, jax.devices("cpu")[:1]), weights(), X, device=DEVICE, quiet=True)
    plain = jaxmem.analyze(jax.jit(sgd_step), weights(), X, device=DEVICE, quiet=True)
    keys = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "total_bytes")
    assert [placed.xla[k] for k in keys] == [plain.xla[k] for k in keys]


BAD = {
    "not callable": (lambda: jaxmem.analyze(42, device=DEVICE), "not a int"),
    "fails to trace": (lambda: jaxmem.analyze(lambda x: x @ x, jnp.ones((2, 3)), device=DEVICE), "cannot trace"),
    "arguments do not match": (lambda: jaxmem.analyze(sgd_step, weights(), device=DEVICE), "cannot trace"),
    "unknown device": (lambda: jaxmem.analyze(sgd_step, weights(), X, device="h900-1tb"), "device"),
    "arguments to a Traced": (lambda: jaxmem.analyze(jax.jit(sgd_step).trace(weights(), X), X, device=DEVICE),
                              "holds its arguments"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_jaxmem_error_line(case):
    call, words = BAD[case]
    with pytest.raises(jaxmem.JaxmemError) as err:
        call()
    text = str(err.value)
    assert "\n" not in text and words in text, text


@needs_tpu
def test_a_lowered_has_no_plan_and_says_so():
    lowered = jax.jit(sgd_step, donate_argnums=0).trace(weights(), X).lower(lowering_platforms=("tpu",))
    result = jaxmem.analyze(lowered, device=DEVICE, quiet=True)
    assert result.plan is None and result.data["plan_note"] and "no jaxpr" in result.note
    assert result.xla["total_bytes"] > 0 and result.fits is True
    assert "no jaxpr" in str(result) and "no jaxpr" in result.html()
    assert result.peak_buffers and all(row["jaxpr_array"] == "" or row["kind"] for row in result.peak_buffers)


@needs_tpu
def test_pytrees_jit_takes_python_scalars_and_none_leaves():
    def step(state, batch):
        return {"w": state["w"] - state["lr"] * batch.mean(), "lr": state["lr"], "extra": None}

    state = {"w": jnp.ones((128, 128)), "lr": 0.1, "extra": None}
    result = jaxmem.analyze(step, state, jnp.ones((8, 128)), device=DEVICE, donate=0, quiet=True)
    assert result.fits and result.xla["total_bytes"] >= 128 * 128 * 4
