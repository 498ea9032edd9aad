"""The TPU runtime's rules (`runtime/tpu_pool.py`), against the sum the rules imply, computed
by hand on every random program."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from jaxmem.errors import PlanError
from jaxmem.runtime.steps import Leaf, StepProgram
from jaxmem.runtime.tpu_pool import (RUNTIME_BYTES, check_tpu_flags, compile_refused, ignored_gpu_variables,
                                     simulate_tpu_steps)

GRANULE = 512


@st.composite
def programs(draw):
    n = draw(st.integers(1, 6))
    sizes = [GRANULE * draw(st.integers(1, 4096)) for _ in range(n)]
    donated = [draw(st.booleans()) for _ in range(n)]
    arguments = [Leaf(size, donated=d) for size, d in zip(sizes, donated)]
    outputs = []
    for i in range(n):
        if draw(st.booleans()):   # a state output: the next step's argument i
            outputs.append(Leaf(sizes[i], aliases=i if donated[i] else None, state_of=i))
    extra = [GRANULE * draw(st.integers(1, 64)) for _ in range(draw(st.integers(0, 3)))]
    outputs += [Leaf(size) for size in extra]   # a loss, metrics: not state
    temp = GRANULE * draw(st.integers(0, 8192))
    code = GRANULE * draw(st.integers(0, 2048))
    return StepProgram(arguments, outputs, temp), code, draw(st.integers(1, 4))


def expected_peak(program: StepProgram, code: int, steps: int) -> int:
    """The rules' peak: the runtime's buffer, the arguments and the code resident; during a
    step, every output that takes no donated buffer; a donated argument no output takes is gone
    after the first step; from the second step on, the last step's outputs that are not state
    (a loss lives until the next one replaces it); the reservation beside."""
    fresh = sum(o.bytes for o in program.outputs if o.aliases is None)
    taken = {o.aliases for o in program.outputs if o.aliases is not None}
    resident = RUNTIME_BYTES + sum(a.bytes for a in program.arguments) + code
    first = resident + fresh
    gone = sum(a.bytes for i, a in enumerate(program.arguments) if a.donated and i not in taken)
    later = resident - gone + fresh + sum(o.bytes for o in program.outputs if o.state_of is None)
    return max(first, later if steps > 1 else 0) + program.temp_bytes


@settings(max_examples=150, deadline=None)
@given(programs())
def test_peak_is_the_rules_sum(case):
    program, code, steps = case
    verdict = simulate_tpu_steps(program, 1 << 40, steps, code_bytes=code)
    assert verdict.fits
    assert verdict.peak_bytes == expected_peak(program, code, steps)
    summary = verdict.summary()
    assert summary["rules"] == "tpu_runtime" and summary["preallocate"] is False
    assert summary["reserved_bytes"] == program.temp_bytes and summary["code_bytes"] == code


@settings(max_examples=100, deadline=None)
@given(programs())
def test_fits_exactly_when_the_sum_fits(case):
    program, code, steps = case
    peak = expected_peak(program, code, steps)
    assert simulate_tpu_steps(program, peak, steps, code_bytes=code).fits
    small = simulate_tpu_steps(program, peak - GRANULE, steps, code_bytes=code)
    assert not small.fits and small.failed_allocation
    assert "does not fit" in small.line()


def test_the_reservation_is_the_one_given_not_the_temp_figure():
    program = StepProgram([Leaf(1 << 20)], [Leaf(1 << 20, state_of=0)], temp_bytes=8 << 20)
    assert simulate_tpu_steps(program, 1 << 30, 1, reserved_bytes=0).peak_bytes == RUNTIME_BYTES + (2 << 20)
    over = simulate_tpu_steps(program, 4 << 20, 1)
    assert not over.fits and over.failed_allocation == "the program's reservation for its temporaries"


def test_refused_compile_is_a_verdict_with_xla_tpu_s_message():
    class Ref:
        temp_bytes, total_bytes = 20 << 30, 21 << 30
        oom = "RESOURCE_EXHAUSTED: Ran out of memory on HBM ... exceeds available HBM (15.75G)."

    class Chip:
        capacity_bytes = 16_909_336_064

    verdict = compile_refused(Ref(), Chip(), 3)
    assert not verdict.fits and verdict.failed_step == 0
    assert verdict.line().startswith("does not fit: XLA:TPU refuses to compile it: RESOURCE_EXHAUSTED")
    assert verdict.summary()["message"] == Ref.oom


def test_gpu_client_settings_are_refused_and_named():
    with pytest.raises(PlanError, match="--mem-fraction sets JAX's GPU client"):
        check_tpu_flags(0.5, None, None, 3)
    with pytest.raises(PlanError, match="--allocator"):
        check_tpu_flags(None, None, "bfc", 3)
    with pytest.raises(PlanError, match="--steps"):
        check_tpu_flags(None, None, None, 0)
    check_tpu_flags(None, None, None, 1)
    assert ignored_gpu_variables({"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_CLIENT_MEM_FRACTION": ".9"}) == \
        ["XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_CLIENT_MEM_FRACTION"]


@settings(max_examples=60, deadline=None)
@given(programs())
def test_a_loop_of_one_program_and_an_empty_one_is_that_program(case):
    """A loop whose second program takes only the first's state and makes nothing holds what the
    first alone holds; its reservation and code count once each."""
    from jaxmem.runtime.tpu_pool import simulate_tpu_loop

    program, code, steps = case
    alone = simulate_tpu_steps(program, 1 << 40, steps, code_bytes=code)
    empty = StepProgram(list(program.arguments), [], 0)
    loop = simulate_tpu_loop([program, empty], 1 << 40, steps, shared=[{}, {i: i for i in range(len(program.arguments))}],
                             code_bytes=[code, 0], reserved_bytes=[None, 0])
    assert loop.peak_bytes == alone.peak_bytes and loop.reserved_bytes == alone.reserved_bytes


def test_the_loops_reservation_is_the_largest_and_code_adds_up():
    from jaxmem.runtime.tpu_pool import simulate_tpu_loop

    train = StepProgram([Leaf(GRANULE * 8)], [Leaf(GRANULE * 8, state_of=0)], GRANULE * 100)
    evaluate = StepProgram([Leaf(GRANULE * 8), Leaf(GRANULE * 4)], [Leaf(GRANULE)], GRANULE * 300)
    v = simulate_tpu_loop([train, evaluate], 1 << 30, 2, shared=[{}, {0: 0}], code_bytes=[GRANULE * 2, GRANULE * 3],
                          factory={"programs": 4, "code_bytes": GRANULE * 5, "reserved_bytes": GRANULE * 200})
    assert v.reserved_bytes == GRANULE * 300 and v.code_bytes == GRANULE * 10 and v.factory_programs == 4
    # Resident: the runtime, the state, the eval batch, all code; at the peak (the second train
    # step) the eval step's output of the first step and the train step's new state.
    assert v.peak_bytes == RUNTIME_BYTES + GRANULE * (8 + 4 + 10 + 1 + 8) + GRANULE * 300
