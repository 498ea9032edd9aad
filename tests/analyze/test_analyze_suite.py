"""Every suite program goes through `plan()` validly, and the suite has the shape the issue asks for."""

from __future__ import annotations

import importlib

import jax
import numpy as np
import pytest

from jaxmem.compiler.planner import plan
from jaxmem.examples.suite import PROGRAMS, SCALING_LAYERS, transformer_train_step

# Programs that trace and plan in a few seconds here; the rest run with -m slow.
FAST = ["mlp_forward", "mlp_train", "mlp_train_donated", "transformer_forward", "cnn_forward",
        "rnn_scan_grad", "while_cond", "parallel_branches"]
SLOW = [name for name in PROGRAMS if name not in FAST]


def _nbytes(leaves) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves)


def _check_program(name: str) -> None:
    program = PROGRAMS[name]
    fn, args = program.factory()
    result = plan(fn, *args, donate_argnums=program.donate_argnums, xla=False)
    assert result.valid, name
    assert result.peak_bytes >= result.lower_bound_bytes > 0
    assert result.argument_bytes == _nbytes(jax.tree_util.tree_leaves(args))
    assert result.output_bytes == _nbytes(jax.tree_util.tree_leaves(jax.eval_shape(fn, *args)))
    # The peak can never be below what is live on entry and on exit, all at once.
    assert result.peak_bytes >= max(result.argument_bytes, result.output_bytes)


@pytest.mark.parametrize("name", FAST)
def test_analyze_suite_program_plans_validly(name):
    _check_program(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_analyze_suite_program_plans_validly_slow(name):
    _check_program(name)


def test_analyze_suite_covers_the_issue():
    assert len(PROGRAMS) >= 10
    kinds = {p.kind for p in PROGRAMS.values()}
    assert kinds == {"forward", "training", "control"}
    donated = [p for p in PROGRAMS.values() if p.donate_argnums]
    assert {p.name for p in donated} >= {"mlp_train_donated", "transformer_train_donated"}
    assert all(p.donate_argnums == (0, 1) for p in donated)
    assert SCALING_LAYERS == (6, 12, 24, 48)


def test_analyze_suite_targets_name_their_factories():
    for program in PROGRAMS.values():
        module, _, attr = program.target.partition(":")
        assert getattr(importlib.import_module(module), attr) is program.factory, program.name


def test_analyze_suite_primitives_are_the_promised_ones():
    """The programs really contain the constructs they are named for (checked on JAX's jaxpr)."""
    def primitives(name):
        fn, args = PROGRAMS[name].factory()
        found = set()

        def walk(jaxpr):
            for eqn in jaxpr.eqns:
                found.add(eqn.primitive.name)
                for value in eqn.params.values():
                    for sub in value if isinstance(value, (tuple, list)) else (value,):
                        inner = getattr(sub, "jaxpr", None)
                        if inner is not None:
                            walk(inner if hasattr(inner, "eqns") else inner.jaxpr)
                        elif hasattr(sub, "eqns"):
                            walk(sub)
        walk(jax.make_jaxpr(fn)(*args).jaxpr)
        return found

    cnn = primitives("cnn_forward")
    assert "conv_general_dilated" in cnn and {"reduce_window_max", "reduce_window_sum"} <= cnn
    assert "scan" in primitives("rnn_scan_grad")
    control = primitives("while_cond")
    assert {"while", "cond"} <= control


@pytest.mark.slow
@pytest.mark.parametrize("layers", SCALING_LAYERS)
def test_analyze_scaling_transformers_plan_validly(layers):
    fn, args = transformer_train_step(layers)
    result = plan(fn, *args, xla=False)
    assert result.valid and result.peak_bytes >= result.lower_bound_bytes
