"""XLA reference figures: sane against the arrays themselves, and the scheduler flags really act."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import textwrap

from jaxmem.errors import PlanError
from jaxmem.examples.suite import PROGRAMS
from jaxmem.xla.cpu.compile import (SCHEDULER_FLAGS, YNN_OFF, scheduler_env, xla_reference,
                            xla_reference_in_subprocess)


def _nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


@pytest.mark.parametrize("name", ["mlp_train", "while_cond", "rnn_scan_grad", "cnn_forward"])
def test_analyze_xla_argument_bytes_equal_the_arguments(name):
    fn, args = PROGRAMS[name].factory()
    ref = xla_reference(fn, args)
    assert ref.argument_bytes == _nbytes(args)
    # XLA may add a few bytes of tuple index tables to the outputs, never less than the arrays.
    outputs = _nbytes(jax.eval_shape(fn, *args))
    assert outputs <= ref.output_bytes <= outputs + 64 * len(jax.tree_util.tree_leaves(jax.eval_shape(fn, *args)))
    assert ref.total_bytes == ref.argument_bytes + ref.output_bytes + ref.temp_bytes - ref.alias_bytes


def test_analyze_xla_donation_shows_up_as_alias_bytes():
    fn, args = PROGRAMS["mlp_train"].factory()
    plain = xla_reference(fn, args)
    donated = xla_reference(fn, args, donate_argnums=(0, 1))
    assert plain.alias_bytes == 0
    # Parameters and both Adam moments come back with the same shapes: all can be aliased.
    params_and_state = _nbytes(args[0]) + _nbytes(args[1])
    assert donated.alias_bytes >= params_and_state - 1024
    assert donated.total_bytes < plain.total_bytes


def test_analyze_xla_kwargs_are_traced():
    ref = xla_reference(lambda x, *, y: x + y, (jnp.ones(256),), kwargs={"y": jnp.ones(256)})
    assert ref.argument_bytes == 2048


def test_analyze_xla_compile_failure_is_a_plan_error():
    with pytest.raises(PlanError, match="XLA could not compile"):
        xla_reference(lambda a, b: a @ b, (jnp.ones((2, 3)), jnp.ones((4, 5))))


def test_analyze_scheduler_env_replaces_the_flag_and_keeps_others():
    env = scheduler_env("bfs", {"XLA_FLAGS": "--xla_cpu_scheduler_type=OLD --xla_dump_to=/tmp/x", "A": "1"})
    assert env["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/x", f"--xla_cpu_scheduler_type={SCHEDULER_FLAGS['bfs']}"]
    assert env["A"] == "1" and env["JAX_PLATFORMS"] == "cpu"
    assert "xla_cpu_scheduler_type" not in scheduler_env(None, {"XLA_FLAGS": "--xla_cpu_scheduler_type=OLD"})["XLA_FLAGS"]
    with pytest.raises(PlanError, match="scheduler must be"):
        scheduler_env("lifo", {})


TOWERS = """
from jaxmem.examples.control import make_parallel_branches

def make():
    return make_parallel_branches(batch=128, in_dim=128, width=512, branches=4, depth=3)
"""

def _target(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return f"{path}:make"


def test_analyze_scheduler_flags_change_xla_figures(tmp_path):
    """Parallel towers: XLA's memory-optimized (DFS) order holds one tower at a time, the
    concurrency-optimized (BFS) order several; if the flag were ignored, both would be equal."""
    target = _target(tmp_path, "towers_target", TOWERS)
    dfs = xla_reference_in_subprocess(target, scheduler="dfs")
    bfs = xla_reference_in_subprocess(target, scheduler="bfs")
    from jaxmem.compiler.target import load_target

    fn, args = load_target(target)
    assert dfs.scheduler == "dfs" and bfs.scheduler == "bfs"
    assert dfs.argument_bytes == bfs.argument_bytes == _nbytes(args)
    assert dfs.temp_bytes < bfs.temp_bytes


def test_analyze_ynn_off_counts_the_convolution_intermediates():
    """With YNNPACK fusions on, XLA:CPU reports almost no temp for the suite's CNN forward; with
    them off the first conv's output (16*64*64*32 floats) is counted, as any executor must store it."""
    target = PROGRAMS["cnn_forward"].target
    hidden = xla_reference_in_subprocess(target, scheduler="dfs")
    counted = xla_reference_in_subprocess(target, scheduler="dfs", extra_flags=YNN_OFF)
    assert counted.argument_bytes == hidden.argument_bytes
    assert counted.temp_bytes >= 16 * 64 * 64 * 32 * 4 > hidden.temp_bytes


def test_analyze_subprocess_reference_matches_in_process_for_the_same_flags(tmp_path):
    target = _target(tmp_path, "donated_target", """
        from jaxmem.examples.mlp import make_train_step

        def make():
            return make_train_step(depth=2, width=256, in_dim=128, classes=10, batch=64)
    """)
    child = xla_reference_in_subprocess(target, donate_argnums=(0, 1))
    from jaxmem.compiler.target import load_target

    fn, args = load_target(target)
    here = xla_reference(fn, args, donate_argnums=(0, 1))
    assert (child.argument_bytes, child.output_bytes, child.alias_bytes) == \
        (here.argument_bytes, here.output_bytes, here.alias_bytes)
    assert child.alias_bytes > 0


def test_analyze_subprocess_bad_target_is_one_line():
    with pytest.raises(PlanError) as info:
        xla_reference_in_subprocess("jaxmem.examples.suite:no_such_program", scheduler="dfs")
    assert "no attribute" in str(info.value) and "\n" not in str(info.value)


def test_analyze_library_fusion_hides_the_dot_result_from_xla_temp():
    """XLA:CPU hands dot->tanh->sum to YNNPACK as one fusion: its temp is 0 though the dot's
    result (256x512 float32) exists inside the library; the reference names exactly those bytes."""
    import jax.numpy as jnp

    from jaxmem.xla.cpu.compile import xla_reference

    ref = xla_reference(lambda x, w: jnp.tanh(x @ w).sum(), (jnp.ones((256, 512)), jnp.ones((512, 512))))
    if ref.library_fusions == 0:
        assert ref.library_hidden_bytes == 0  # a jaxlib without YNNPACK fusions stores the dot as temp
        assert ref.temp_bytes >= 256 * 512 * 4
    else:
        assert ref.library_hidden_bytes == 256 * 512 * 4
        assert ref.temp_bytes < 256 * 512 * 4
