"""Robustness on programs outside jaxmem's suite: typed PRNG keys, packed sub-byte dtypes and
the primitives newer JAX emits, each checked against XLA's own figures or JAX's values."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxmem.compiler.jaxpr_adapter import aval_bytes
from jaxmem.xla.gpu import unavailable_reason, xla_gpu_reference

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
