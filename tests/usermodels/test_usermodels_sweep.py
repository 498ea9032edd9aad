"""Robustness on programs outside jaxmem's suite: typed PRNG keys, packed sub-byte dtypes and
the primitives newer JAX emits, each checked against XLA's own figures or JAX's values."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.compiler.jaxpr_adapter import aval_bytes
from jaxmem.xla.gpu.compile import unavailable_reason, xla_gpu_reference

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sweep_programs.py")
needs_gpu_compiler = pytest.mark.skipif(unavailable_reason() is not None,
                                        reason=f"deviceless XLA:GPU unavailable: {unavailable_reason()}")


@pytest.mark.parametrize("make", [
    lambda: jnp.ones((512, 512), jnp.int4), lambda: jnp.ones((3, 5), jnp.uint4),
    lambda: jnp.ones((7,), jnp.int2), lambda: jnp.ones((33, 3), jnp.float4_e2m1fn),
    lambda: jnp.ones((9,), jnp.bool_), lambda: jnp.ones((4, 4), jnp.float8_e4m3fn),
    lambda: jax.random.key(0), lambda: jax.random.split(jax.random.key(0), 5),
], ids=["int4", "uint4-odd", "int2", "float4", "bool", "fp8", "key", "keys"])
def test_value_bytes_are_what_xla_stores(make):
    """XLA packs sub-byte types (int4 was counted a byte an element, twice XLA's figure) and
    sizes a typed key by its key data (np.dtype could not read key<fry>)."""
    x = make()
    stats = jax.jit(lambda a: a).lower(x).compile().memory_analysis()
    assert aval_bytes(x) == stats.argument_size_in_bytes


@needs_gpu_compiler
@pytest.mark.parametrize("name", ["typed_key_dropout", "int4_weights"])
def test_xla_gpu_reference_sizes_every_argument_as_xla_does(name):
    """A typed key argument made the deviceless XLA:GPU compile fail ('Cannot interpret
    key<fry> as a data type'); an int4 one was sized at twice XLA's bytes. The per-leaf argument
    bytes now add up to XLA:GPU's own argument figure."""
    ref = xla_gpu_reference(f"{HERE}:{name}", device="h100-80gb", top=0, use_cache=False)
    assert sum(a["bytes"] for a in ref.arguments) == ref.argument_bytes


def _analyze_json(target: str, *extra: str) -> dict:
    import json
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "jaxmem", "analyze", target, "--json", "--xla", "cpu", *extra],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_newer_jax_primitives_are_known_and_run_to_jax_values():
    """jnp.stack, jnp.unstack, jnp.tile and jnp.searchsorted's `le_to` are primitives of their
    own in newer JAX, and a cond pads its branches' residuals with `empty2` (the sweep's KV-cache decode and switch steps reported `stack`, `empty2`
    unknown and planned them conservatively). Each now has its rule from JAX's lowering: the
    plan is valid, and run at its offsets it gives jax.jit's values."""
    report = _analyze_json(f"{HERE}:stacked_layers", "--execute")
    assert report["unknown_primitives"] == []
    assert report["valid"] and report["execute"]["ok"], report["execute"]


def test_tile_read_by_one_multiply_is_not_stored():
    """XLA computes `jnp.tile`'s rows inside the multiply that reads them (XLA:CPU's total
    holds the two arguments and the output only); planned as an unknown primitive the tiled
    32 MiB was stored, twice XLA:CPU's total."""
    from sweep_programs import tiled_scale

    fn, args = tiled_scale()
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    xla_total = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    report = _analyze_json(f"{HERE}:tiled_scale")
    assert report["unknown_primitives"] == []
    assert report["peak_bytes"] <= xla_total, (report["peak_bytes"], xla_total)


def test_optimize_compares_typed_key_outputs_by_their_key_data():
    """`jaxmem optimize` on a step returning its split key ended in a traceback (np.asarray of
    a key<fry> array); it now compares the key data, and the reordered step's values are the
    original's."""
    import json
    import subprocess
    import sys

    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "jaxmem", "optimize", f"{HERE}:typed_key_dropout", "--json"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["values_unchanged"] is True


def test_fit_judges_typed_keys_by_their_key_data():
    """fit's value check (`values_equal`) read keys with np.asarray and raised; equal keys are
    equal and keys split differently are not, as their key data says."""
    from jaxmem.fitting.judge import values_equal

    key = jax.random.key(0)
    same, other = jax.random.split(key)[0], jax.random.split(jax.random.key(1))[0]
    assert values_equal((same, jnp.ones(3)), (jax.random.split(key)[0], jnp.ones(3)))
    assert not np.array_equal(jax.random.key_data(same), jax.random.key_data(other))
    assert not values_equal((same,), (other,))


def test_fit_below_the_arguments_and_outputs_says_why_no_rewrite_ran():
    """A budget under XLA's arguments + outputs (no recomputation lowers those) printed
    'rewrite: not run (a policy meets the budget, ...)', though no policy met it."""
    import subprocess
    import sys

    fn, args = __import__("sweep_programs").typed_key_dropout()
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    floor = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "jaxmem", "fit", f"{HERE}:typed_key_dropout",
                          "--budget", str(floor // 2), "--no-progress", "--no-time", "--no-schedulers"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 1, out.stderr[-2000:]
    text = " ".join(out.stdout.split())
    assert "the budget cannot be met" in text
    assert "a policy meets the budget" not in text


def test_int4_values_made_in_the_step_are_sized_packed_and_run_to_jax_values():
    """An int4 value the step makes is planned at XLA's packed bytes (the plan's outputs equal
    XLA:CPU's output figure), and the planned program still runs to jax.jit's values (numpy
    holds an int4 a byte, so the executor keeps such values outside the arena; sizing them
    packed made it refuse the plan: 'value is 16384 bytes but its type int4[64,512] needs 32768')."""
    import jaxmem
    from jaxmem.execution.verify import compare_with_jit
    from sweep_programs import int4_quantize

    fn, args = int4_quantize()
    # each output compiled alone: XLA's figure for a tuple also counts its pointer table
    xla_outputs = sum(jax.jit(lambda x, k=k: fn(x)[k]).lower(*args).compile().memory_analysis().output_size_in_bytes
                      for k in range(2))
    plan = jaxmem.plan(fn, *args, xla=False)
    assert plan.valid
    assert plan.output_bytes == xla_outputs
    assert compare_with_jit(fn, args, plan)["ok"]


def test_a_jitted_targets_own_donation_is_planned_and_compiled():
    """A TARGET returning `jax.jit(step, donate_argnums=1)` was planned and compiled as if
    nothing were donated (jaxmem wraps it in its own jax.jit, where the inner donation is
    lost). Its donation is now read from its trace: jaxmem's XLA figure is the one XLA gives
    the user's own jitted step, donated weights aliased."""
    from sweep_programs import jitted_donated_sgd

    fn, args = jitted_donated_sgd()
    stats = fn.lower(*args).compile().memory_analysis()
    assert stats.alias_size_in_bytes > 0
    xla_total = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
                 - stats.alias_size_in_bytes)
    report = _analyze_json(f"{HERE}:jitted_donated_sgd")
    assert len(report["donated"]) == len(jax.tree.leaves(args[1]))   # the weights' leaves, not the batch
    assert report["xla_total_bytes"] == xla_total


def test_maxbatch_reads_a_jitted_targets_own_donation():
    """maxbatch compiles the TARGET at many sizes; without `--donate` it planned and compiled a
    step the user jitted with `donate_argnums=1` as if nothing were donated. Each size's program
    now carries JAX's own donation (`jaxmem.api.program.prepare`, per leaf), as analyze's does."""
    from jaxmem.api.maxbatch import program_at
    from jaxmem.compiler.target import resolve_factory

    assert program_at(resolve_factory(f"{HERE}:jitted_donated_sgd"), "batch", 64, None).donated_positions == (1,)
    assert program_at(resolve_factory("jaxmem.examples.gpt:batch_example"), "batch_size", 2, None).donated == [
        False] * len(program_at(resolve_factory("jaxmem.examples.gpt:batch_example"), "batch_size", 2, None).donated)


def test_a_non_array_leaf_is_named_by_its_path_in_one_line():
    """A function leaf in the arguments (an equinox model's activation under eqx.filter_jit) is
    one error line; it said only "Error interpreting argument to _JitWrapper(" (JAX's first
    line, a cut repr) and now names the function, the leaf's path, its type and what to do."""
    import subprocess
    import sys

    from sweep_programs import function_leaf

    fn, args = function_leaf()
    with pytest.raises(TypeError) as jax_error:
        jax.make_jaxpr(fn)(*args)
    assert "activation" in str(jax_error.value) and "Wrapped(\n" in str(jax_error.value)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "jaxmem", "analyze", f"{HERE}:function_leaf", "--xla", "cpu"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.startswith("jaxmem analyze: error:")]
    assert len(lines) == 1 and "Traceback" not in out.stderr
    assert "['activation']" in lines[0] and "Wrapped's argument" in lines[0], lines[0]
    assert "cannot take as an argument" in lines[0] and "eqx.filter_jit" in lines[0]
