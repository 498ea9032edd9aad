"""The one alias analysis (`compiler.aliasing`) against JAX's own lowering: the pairs JAX writes
as `tf.aliasing_output`, and the donors it marks `jax.buffer_donor`."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.compiler.aliasing import donation_aliases
from jaxmem.compiler.program import drop_dead
from jaxmem.examples.suite import ALL_PROGRAMS


def _jax_pairs(fn, args, donate):
    """(output -> flat argument, donors) as JAX's lowering states them."""
    lowered = jax.jit(fn, donate_argnums=donate).lower(*args)
    kept = sorted(int(i) for i in lowered._lowering.compile_args["kept_var_idx"])
    head = next(line for line in lowered.as_text().splitlines() if "func.func public @main" in line)
    pairs, donors = {}, set()
    for chunk in head.split("%arg")[1:]:
        number = int(chunk.split(":", 1)[0])
        found = re.search(r"tf\.aliasing_output = (\d+)", chunk)
        if found:
            pairs[int(found.group(1))] = kept[number]
        elif "jax.buffer_donor" in chunk:
            donors.add(kept[number])
    return pairs, donors


def _ours(fn, args, donate):
    traced = ja.trace(fn, tuple(args), {}, tuple(donate))
    g = drop_dead(ja.inline(traced.closed_jaxpr))
    flags = [k in traced.donated for k in range(len(g.invars))]
    result = donation_aliases(g, flags, constant_outputs=True)
    return result.outputs, set(result.donors)


CASES = {
    # an unused donated argument is dropped before pairing; same-shape outputs pair in order
    "unused_and_order": (lambda a, b, c: (b + 1, a * 2, b - 1), (jnp.ones(8), jnp.ones(8), jnp.ones(8)), (0, 1, 2)),
    # dtype must match too; the unpaired donated argument is a donor
    "dtype": (lambda a, b: (a.astype(jnp.float16), b.sum()), (jnp.ones(8), jnp.ones(8)), (0, 1)),
    # a constant output is paired like any other
    "constant_output": (lambda a: (jnp.zeros(8), a * 3), (jnp.ones(8),), (0,)),
    # an argument returned unchanged
    "returned_argument": (lambda a, b: (a, b + 1), (jnp.ones(4), jnp.ones(4)), (0, 1)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_pairs_are_jaxs_on_small_cases(name):
    fn, args, donate = CASES[name]
    assert _ours(fn, args, donate) == _jax_pairs(fn, args, donate)


@pytest.mark.parametrize("name", ["mlp_train_donated", "transformer_train_donated", "moe_train", "scanned_transformer_train"])
def test_pairs_are_jaxs_on_suite_programs(name):
    program = ALL_PROGRAMS[name]
    fn, args = program.factory()
    assert _ours(fn, args, program.donate_argnums) == _jax_pairs(fn, args, program.donate_argnums)
