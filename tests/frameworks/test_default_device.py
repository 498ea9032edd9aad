"""With no device named, a step is judged for the device its arguments live on: the chip or GPU
their arrays are on, else JAX's default device where it is a GPU or TPU, else (no accelerator in
sight) an H100 80GB; the result says which and why. On a TPU v5e the choice was recorded."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

import jaxmem
from jaxmem.api.devices import choose_device
from framework_chip import chip_rows


class FakeDevice:
    def __init__(self, platform, kind, limit=None, name="dev0"):
        self.platform, self.device_kind, self.limit, self.name = platform, kind, limit, name

    def memory_stats(self):
        return {"bytes_limit": self.limit} if self.limit else None

    def __str__(self):
        return self.name


CPU = FakeDevice("cpu", "cpu", name="TFRT_CPU_0")


@pytest.mark.parametrize("device, preset", [
    (FakeDevice("tpu", "TPU v5 lite", 16_909_336_064, "TPU_0"), "tpu-v5e-16gb"),
    (FakeDevice("tpu", "TPU v6 lite", 33_550_237_696, "TPU_0"), "tpu-v6e-32gb"),
    (FakeDevice("gpu", "NVIDIA H100 80GB HBM3", 85_520_809_984, "cuda:0"), "h100-80gb"),
    (FakeDevice("gpu", "NVIDIA A100-SXM4-80GB", 85_899_345_920, "cuda:0"), "a100-80gb"),
    (FakeDevice("gpu", "NVIDIA A100-SXM4-40GB", 42_949_672_960, "cuda:0"), "a100-40gb"),
])
def test_the_arguments_device_is_judged_for(device, preset):
    choice = choose_device([CPU, device], default=lambda: CPU)
    assert choice.device == preset
    assert choice.reason == f"the arguments are on {device.name} ({device.device_kind})"


def test_jaxs_default_device_when_the_arguments_name_none():
    chip = FakeDevice("tpu", "TPU v5 lite", 16_909_336_064, "TPU_0")
    choice = choose_device([], default=lambda: chip)
    assert (choice.device, choice.reason) == ("tpu-v5e-16gb", "JAX's default device is TPU_0 (TPU v5 lite)")


def test_a_device_without_a_preset_is_judged_on_its_memory():
    choice = choose_device([FakeDevice("gpu", "NVIDIA B200", 191_000_000_000, "cuda:0")], default=lambda: CPU)
    assert choice.device == "191000000000" and "no preset" in choice.reason


def test_with_no_accelerator_in_sight_an_h100_and_why():
    result = jaxmem.analyze(lambda w, x: (x @ w).sum(), jnp.ones((64, 64)), jnp.ones((8, 64)), quiet=True,
                            costs=False)
    assert result.device == "h100-80gb"
    assert result.device_reason.startswith("no GPU or TPU in sight (JAX's default device is")
    assert "judged for" in result.text(width=200)


def test_a_named_device_is_not_second_guessed():
    result = jaxmem.analyze(lambda x: x * 2, jnp.ones(8), device="8GiB", quiet=True)
    assert result.device == "8GiB" and result.device_reason is None


ANALYSED = {name: row["analyze"] for name, row in chip_rows().items() if row.get("analyze")}


@pytest.mark.parametrize("name", sorted(ANALYSED))
def test_on_a_tpu_v5e_the_chip_is_judged_for_without_being_told(name):
    # Recorded on a machine with a TPU v5e: jaxmem.analyze(step, *args) with the arrays the
    # step's factory made on the chip, no device named.
    analysed, row = ANALYSED[name], chip_rows()[name]
    assert analysed["device"] == "tpu-v5e-16gb"
    assert analysed["chosen_because"].startswith("the arguments are on TPU_0") and "(TPU v5 lite)" in analysed["chosen_because"]
    m = row["memory_analysis"]
    assert analysed["xla"]["total_bytes"] == m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]
    assert 0.98 <= analysed["pool_peak_bytes"] / row["chip_peak_bytes"] <= 1.05


def test_three_steps_were_analysed_on_the_chip():
    assert {"eval/nnx_cnn_plain", "eval/keras_functional_adamw", "tuning/nnx_mlp_plain"} <= set(ANALYSED)
