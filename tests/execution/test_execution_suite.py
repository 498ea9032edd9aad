"""Every benchmark-suite program, planned, against jax.jit (minutes: run with `-m slow`)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxmem
from execution_oracle import matches_jit
from jaxmem.examples.suite import PROGRAMS


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_suite_program_runs_planned_with_jax_jit_results(name):
    program = PROGRAMS[name]
    fn, args = program.factory()
    f = jaxmem.jit(fn, donate_argnums=program.donate_argnums)
    executable = f.lower(*args)
    assert executable.plan.valid
    assert executable.arena.nbytes == executable.plan.arena_bytes
    executable.arena[:] = 0xFF  # NaN everywhere before the run
    ours = f(*args)
    reference = jax.jit(fn)(*args)
    problems = matches_jit(ours, reference)
    assert not problems, problems
    executable.arena[:] = 0x00
    again = f(*args)
    for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
