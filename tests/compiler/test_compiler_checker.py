"""The checker is not vacuous: each kind of corruption of a valid plan is caught."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import pytest

from jaxmem.compiler.checker import check_plan
from jaxmem.compiler.planner import plan

N = 4096


def _program(x, w):
    a = jnp.tanh(x @ w)
    b = jnp.sin(a) @ w
    c = jnp.exp(b) * a
    return c.sum(axis=0), b


@pytest.fixture(scope="module")
def valid():
    p = plan(_program, jnp.ones((64, 256)), jnp.ones((256, 256)), xla=False)
    assert check_plan(p) == [] and p.valid
    return p


def _clone(p):
    """A copy whose buffers, values and steps can be corrupted without touching the original
    (the jaxpr equations themselves are shared, read-only)."""
    q = copy.copy(p)
    q.buffers = [copy.copy(b) for b in p.buffers]
    for b in q.buffers:
        b.values = list(b.values)
    q.values = {k: copy.copy(v) for k, v in p.values.items()}
    q.schedule = [copy.copy(s) for s in p.schedule]
    return q


def _temps(p):
    return [b for b in p.buffers if b.kind == "temp" and b.size > 0]


def test_overlapping_live_buffers_are_caught(valid):
    p = _clone(valid)
    live = sorted((b for b in p.buffers if b.size), key=lambda b: b.start)
    pair = next((a, b) for a in live for b in live
                if a.id < b.id and a.start <= b.end and b.start <= a.end)
    pair[1].offset = pair[0].offset
    assert any("overlap" in m for m in check_plan(p))


def test_misaligned_offset_is_caught(valid):
    p = _clone(valid)
    p.buffers[0].offset += 128
    p.arena_bytes += 256
    p.peak_bytes += 256
    assert any("aligned" in m for m in check_plan(p))


def test_buffer_outside_the_arena_is_caught(valid):
    p = _clone(valid)
    p.arena_bytes -= 256
    problems = check_plan(p)
    assert any("outside the arena" in m for m in problems)


def test_read_after_the_buffer_died_is_caught(valid):
    p = _clone(valid)
    buf = next(b for b in _temps(p) if b.end > b.start)
    buf.end = buf.start
    assert any("live only" in m or "reads value" in m for m in check_plan(p))


def test_value_overwritten_before_its_last_read_is_caught(valid):
    p = _clone(valid)
    # Put a later temporary into an earlier one's buffer although the earlier is still read.
    temps = sorted(_temps(p), key=lambda b: b.start)
    first = next(b for b in temps if b.end > b.start + 1)
    later = next(b for b in temps if first.start < b.start < first.end and b.size <= first.size)
    for v in later.values:
        p.values[v].buffer = first.id
        first.values.append(v)
    later.values = []
    assert any("overwritten" in m for m in check_plan(p))


def test_output_freed_before_the_exit_is_caught(valid):
    p = _clone(valid)
    out = p.values[p.outvars[0]]
    p.buffers[out.buffer].end -= 1
    assert any("before the exit" in m for m in check_plan(p))


def test_schedule_out_of_dependency_order_is_caught(valid):
    p = _clone(valid)
    k = next(i for i, s in enumerate(p.schedule) if s.inputs and any(p.values[v].producer is not None for v in s.inputs))
    reader = p.schedule[k]
    v = next(v for v in reader.inputs if p.values[v].producer is not None)
    p.values[v].producer = k  # claims the value is made at (not before) the step reading it
    assert check_plan(p)


def test_wrong_peak_and_lower_bound_are_caught(valid):
    p = _clone(valid)
    p.peak_bytes -= 256
    p.lower_bound_bytes += 256
    problems = check_plan(p)
    assert any(m.startswith("peak") for m in problems)
    assert any(m.startswith("lower bound") for m in problems)


def test_fused_program_output_is_caught(valid):
    p = _clone(valid)
    out = p.values[p.outvars[1]]
    out.buffer = None
    assert check_plan(p)
