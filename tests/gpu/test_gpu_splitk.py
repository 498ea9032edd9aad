"""XLA:GPU's Triton split-K (`jaxmem.xla.gpu.model.splitk`) against XLA:GPU compiled deviceless.

The split factor on a grid of GEMMs (sizes, batch, float32 and bfloat16, a float32 operand cast
to bfloat16; most not in the suite) read from the optimized HLO of each compile: the GEMM
fusion's output holds `s` times the result's elements. Then the memory of the partials, per
rule program (`fusion_programs.py`): held until the consumer that absorbs the reduce, or a
temporary beside the stored result when a GEMM reads it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.xla.gpu.compile import GPU_TARGETS, xla_gpu_reference
from jaxmem.xla.gpu.model.predict import predict
from jaxmem.xla.gpu.model.splitk import dot_split, split_k

from gpu_test_support import needs_gpu_compiler, FUSION, load_fusion_program

HERE = Path(__file__).resolve().parent
DEVICES = ("h100-80gb", "a100-40gb")

# (batch or 0, m, n, k, dtype, cast): `cast` feeds a float32 lhs through a bfloat16 cast.
CASES = [
    (0, 512, 2048, 2048, "float32", False), (0, 512, 512, 2048, "float32", False),
    (0, 1024, 10, 1024, "float32", False), (0, 1024, 1024, 1024, "float32", False),
    (0, 128, 128, 8192, "float32", False), (0, 100, 300, 5000, "float32", False),
    (0, 2048, 2048, 512, "float32", False), (0, 200, 200, 200, "float32", False),
    (0, 256, 256, 16384, "bfloat16", False), (0, 1000, 1000, 3000, "bfloat16", False),
    (0, 64, 4096, 4096, "bfloat16", False), (4, 256, 256, 2048, "float32", False),
    (8, 128, 128, 1024, "bfloat16", False), (0, 1000, 1000, 3000, "bfloat16", True),
]


def _case(case: tuple) -> tuple:
    """(fn, abstract args) of one grid case."""
    import jax
    import jax.numpy as jnp

    b, m, n, k, dtype, cast = case
    lead = (b,) if b else ()
    lhs_dtype = "float32" if cast else dtype
    args = (jax.ShapeDtypeStruct(lead + (m, k), lhs_dtype), jax.ShapeDtypeStruct(lead + (k, n), dtype))

    def fn(x, y):
        x = x.astype(dtype) if cast else x
        return jnp.matmul(x, y)
    return fn, args


def xla_splits(device: str) -> list[int]:
    """Per case, the split factor in XLA:GPU's optimized HLO (compiled deviceless here, JAX on
    the CPU platform): the Triton GEMM fusion's elements over the dot result's."""
    import jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxmem.units import PRESETS
    from jaxmem.xla.gpu.compile import target_config, with_memory

    text = with_memory(target_config(GPU_TARGETS[device]), PRESETS[device])
    topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x1")
    sharding = NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), PartitionSpec())
    out = []
    for case in CASES:
        fn, args = _case(case)
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
        hlo = jax.jit(fn).trace(*args).lower().compile().as_text()
        b, m, n = max(1, case[0]), case[1], case[2]
        gemm = [line for line in hlo.splitlines() if "kind=kCustom" in line and "gemm_fusion" in line.split("=")[0]]
        dims = re.search(r"= \w+\[([\d,]*)\]", gemm[0]).group(1)
        elements = 1
        for d in dims.split(","):
            elements *= int(d)
        out.append(elements // (b * m * n))
    return out


@pytest.fixture(scope="module")
def measured() -> dict[str, list[int]]:
    code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import test_gpu_splitk as t; "
            f"print(json.dumps({{d: t.xla_splits(d) for d in {list(DEVICES)!r}}}))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=900, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
def test_split_factor_matches_xla_gpu_on_a_grid(measured, device):
    """The cost model's factor for each GEMM of the grid, from the traced jaxpr's dot (its
    dimensions and operand widths, as `xla.gpu.model.predict` sees it), is XLA:GPU's."""
    import jax

    predicted = []
    for case in CASES:
        fn, args = _case(case)
        g = ja.inline(jax.make_jaxpr(fn)(*args))
        dots = [op for op in g.ops if op.primitive == "dot_general"]
        predicted.append(dot_split(g, dots[0], device))
    assert predicted == measured[device]
    assert len(set(measured[device])) >= 4   # the grid spans several factors, 1 included
    assert 1 in measured[device]


def test_split_factor_follows_the_device():
    """A100's lower memory weight splits less than H100; an unknown preset never splits."""
    assert split_k(1, 512, 2048, 2048, "h100-80gb") == 2 and split_k(1, 512, 2048, 2048, "a100-40gb") == 1
    assert split_k(1, 512, 512, 2048, "cpu") == 1


# name -> how many (512 x 512) GEMMs' worth of partials XLA holds at once at its peak (None:
# not checked; the residual program's peak holds other temporaries too)
SPLITK_RULES = {"splitk_partials_held": 2, "splitk_reduced_for_gemm": 1, "splitk_merged_dots": 1,
                "splitk_column_sum": 1, "splitk_residual_stored": None}


@needs_gpu_compiler
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(SPLITK_RULES))
def test_splitk_partials_match_xla_gpu_temp(name, device):
    """The rule programs' temp is XLA:GPU's (within 2%), and more than the unsplit results'
    (what the model predicted before the rule): the partials are in it."""
    _, factory = load_fusion_program(name)
    fn, args = factory()
    traced = ja.trace(fn, args, {}, ())
    pred = predict(traced.closed_jaxpr, donated=[False] * len(traced.in_avals), device=device)
    ref = xla_gpu_reference(f"{FUSION}:{name}", device=device, top=0)
    assert (pred.argument_bytes, pred.output_bytes) == (ref.argument_bytes, ref.output_bytes)
    assert abs(pred.temp_bytes / ref.temp_bytes - 1) <= 0.02, (pred.temp_bytes, ref.temp_bytes)
    # each unsplit result is 1 MiB; XLA's temp holds the partials (4 MiB on A100, 8 on H100):
    # two at once where the concatenate reads both, one where the reduce is its own fusion
    # and where two merged GEMMs split as one
    partials = 4 * 2 ** 20 * (2 if device == "h100-80gb" else 1)
    held = SPLITK_RULES[name]
    assert held is None or held * partials <= ref.temp_bytes < (held + 1) * partials, ref.temp_bytes
