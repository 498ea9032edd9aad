"""The programs a factory runs before the step (`xla.tpu.factory`): recorded while jaxmem runs
the factory, compiled for the chip; each stays resident on a TPU at XLA:TPU's code figure (as a
v5e showed, tests/tpu/test_tpu_chip_models.py). The truth here: the same two programs compiled
through `jax.jit(...).lower().compile()` for the chip, each on its own."""

from __future__ import annotations

import os

import pytest

from jaxmem.runtime.steps import program_from_reference
from jaxmem.runtime.tpu_pool import simulate_tpu_steps
from jaxmem.xla.tpu.compile import xla_tpu_reference

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.usefixtures("needs_libtpu")
def test_a_factorys_programs_are_counted_at_their_code():
    ref = xla_tpu_reference(os.path.join(HERE, "tpu_programs.py:eager_factory"), "tpu-v5e-16gb", top=0)
    ones = xla_tpu_reference(os.path.join(HERE, "tpu_programs.py:ones_alone"), "tpu-v5e-16gb", top=0)
    doubled = xla_tpu_reference(os.path.join(HERE, "tpu_programs.py:doubled_alone"), "tpu-v5e-16gb", top=0)
    # `make_ones` takes no arguments: a program of constants, which leaves no code on the chip.
    assert ones.generated_code_bytes == 0
    assert ref.factory["programs"] == 1
    assert ref.factory["code_bytes"] == doubled.generated_code_bytes > 0
    alone = simulate_tpu_steps(program_from_reference(ref), 1 << 34, 3, code_bytes=ref.generated_code_bytes,
                               reserved_bytes=ref.reserved_bytes)
    with_factory = simulate_tpu_steps(program_from_reference(ref), 1 << 34, 3, code_bytes=ref.generated_code_bytes,
                                      reserved_bytes=ref.reserved_bytes, factory=ref.factory)
    assert with_factory.peak_bytes - alone.peak_bytes == ref.factory["code_bytes"]
    assert with_factory.factory_programs == 1


@pytest.mark.usefixtures("needs_libtpu")
def test_an_abstract_factory_runs_nothing():
    ref = xla_tpu_reference(os.path.join(HERE, "tpu_programs.py:doubled_alone"), "tpu-v5e-16gb", top=0)
    assert not ref.factory
