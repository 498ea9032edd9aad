"""Every framework's step gives the figures of the program that framework compiles.

The truth for each step of `benchmarks/framework_steps` is XLA's `memory_analysis()` of the
program the framework itself compiles, built the framework's own way (`module.lowered()`:
`nnx.jit(step).lower(...)`, Keras's own train function, `eqx.filter_jit(step).lower(...)`):
here on XLA:CPU, and on a TPU v5e where the chip compiled it (recorded). jaxmem reads the step
from what a user hands it (`module.make()`), through `jaxmem.frameworks`.
"""

from __future__ import annotations

import pytest

from steps import figures, jaxmem_program, load, names, tpu_figures_and_pool
from framework_chip import chip_rows, waited_loop_peaks

FIGURES = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")


# The two slowest compiles here (15 s each on 2 cores) run with the slow cases, as does the tuning
# set (the steps the code was written against); the evaluation set's other ten run by default.
SLOW_CPU = ("eval/linen_lm_remat_dropout", "eval/haiku_resnet_state")


def _marked(name: str):
    slow = name in SLOW_CPU or name.startswith("tuning/")
    return pytest.param(name, marks=pytest.mark.slow) if slow else name


@pytest.mark.parametrize("name", [_marked(n) for n in names("both")])
def test_the_program_is_the_frameworks_own_on_xla_cpu(name):
    from jaxmem.xla.cpu.compile import reference_from_lowered

    module = load(name)
    truth = figures(module.lowered().compile().memory_analysis())
    program = jaxmem_program(name)
    ref = reference_from_lowered(program.lower_for("cpu"))
    assert {k: int(getattr(ref, k)) for k in FIGURES} == truth
    wanted = getattr(module, "READ_AS", None) or {"flax.nnx": "flax.nnx", "equinox": "equinox",
                                                  "keras": "keras"}.get(module.FRAMEWORK, "jax")
    assert program.framework == wanted


CHIP_ROWS = chip_rows()
FAST = ("eval/nnx_cnn_plain",)   # one deviceless XLA:TPU case in the default run; the rest are slow
# Steps whose user loop holds more than the step: the linen LM is not donated, its `run` keeps
# the first state alive and does not wait between steps, so the chip held 4 states at its peak;
# the same loop with the first state released and each step waited for
# (`results/tpu_v5e_loop_holds.jsonl`) is what the step itself needs.
LOOP_HOLDS = waited_loop_peaks()


def _chip_case(name):
    return pytest.param(name, marks=() if name in FAST else pytest.mark.slow)


@pytest.mark.parametrize("name", [_chip_case(n) for n in sorted(CHIP_ROWS)])
def test_xla_tpu_figures_equal_the_chips_and_the_pool_is_near_its_peak(name, needs_libtpu):
    row = CHIP_ROWS[name]
    tpu, pool = tpu_figures_and_pool(name, factory_on_chip="placed" not in row["stats"])
    truth = row["memory_analysis"]
    assert {k: int(getattr(tpu, k)) for k in (*FIGURES, "generated_code_bytes")} == truth
    ratio = pool.peak_bytes / LOOP_HOLDS.get(name, row["chip_peak_bytes"])
    if name in LOOP_HOLDS:
        assert pool.peak_bytes < row["chip_peak_bytes"]
    if name.startswith("eval/"):   # the tuning set's ratios are reported, not held (BENCHMARKS.md)
        assert 0.98 <= ratio <= 1.05, f"pool {pool.peak_bytes} against the chip's {row['chip_peak_bytes']}: {ratio:.4f}"


def test_the_recording_covers_the_evaluation_set():
    # Every step of the evaluation set ran on the chip, each framework at least once, and at
    # least 6 of them with a peak that is the loop's own.
    assert set(names("eval")) <= set(CHIP_ROWS)
    assert len(set(names("eval")) - set(LOOP_HOLDS)) >= 6
    frameworks = {CHIP_ROWS[n]["framework"] for n in names("eval")}
    assert frameworks == {"flax.nnx", "equinox", "flax.linen", "keras", "haiku", "jax"}
    assert all(CHIP_ROWS[n]["device_kind"] == "TPU v5 lite" for n in CHIP_ROWS)
