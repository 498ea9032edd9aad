"""jaxmem's model of XLA:GPU (`jaxmem.xla.gpu.model.predict`) against XLA:GPU itself, compiled deviceless.

Per fusion rule, a small program (`fusion_programs.py`) whose XLA:GPU buffer assignment shows
the rule: the number of 16 MiB buffers XLA:GPU's temp block holds is the model's too, and the
predicted total is XLA's within a few percent. Then the prediction on suite programs, jaxmem's
GPU-target plan (checked, executed on the host, at or below XLA:GPU), and maxbatch's guess.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from jaxmem.compiler import jaxpr_adapter as ja
from jaxmem.xla.gpu.compile import xla_gpu_reference
from jaxmem.xla.gpu.model.predict import gpu_fusion, plan_on_gpu, predict

from gpu_test_support import needs_gpu_compiler, FUSION, load_fusion_program as _load


def _predict(fn, args, donate=(), device="h100-80gb"):
    traced = ja.trace(fn, args, {}, donate)
    donated = [k in traced.donated for k in range(len(traced.in_avals))]
    return predict(traced.closed_jaxpr, donated=donated, device=device)


RULES = ["elementwise_chain", "broadcast_into_reduction", "gather_into_matvec", "relu_into_gemm",
         pytest.param("tanh_read_twice", marks=pytest.mark.xfail(
             reason="measured: XLA:GPU computes tanh(x) * 2 inside both GEMMs here (temp 0.03 of 16 MiB), "
                    "while the model stores transcendental chains read twice, as mlp_deep_train's dump "
                    "shows for its silu outputs; GEMM fusion's IsInputWorthFusing separates the two (a product "
                    "of two tensors with two readers is stored), but that rule in general failed the suite "
                    "(BENCHMARKS.md)", strict=True)),
         "log_softmax_rows", "outer_product_into_scatter", "max_pool_gradient", "relu_max_pool_gradient", "merged_dots",
         "merged_dots_concatenated",
         "bf16_convert_into_gemm", "bf16_weight_read_twice", "scan_after_large_temporary", "scan_output_into_output"]


@needs_gpu_compiler
@pytest.mark.parametrize("name", RULES)
def test_each_fusion_rule_matches_xla_gpu_buffer_assignment(name):
    _rule_matches_xla(name, "h100-80gb", (), 0.08)


def _rule_matches_xla(name: str, device: str, donate: tuple[int, ...], tolerance: float) -> None:
    """A rule program's prediction against its XLA:GPU compile: the same number of 16 MiB
    intermediates in the temp block, stored exactly where the program says XLA stores one, the
    same argument/output/alias bytes, and the total within `tolerance`."""
    module, factory = _load(name)
    ref = xla_gpu_reference(f"{FUSION}:{name}", device=device, donate_argnums=donate, top=0)
    pred = _predict(*factory(), donate=donate, device=device)
    big = module.BIG
    # What XLA stored: how many of the 16 MiB intermediates its temp block holds at once.
    assert math.floor(pred.temp_bytes / big) == math.floor(ref.temp_bytes / big), (pred.temp_bytes, ref.temp_bytes)
    assert (ref.temp_bytes >= big) == module.STORED[name]
    assert (pred.argument_bytes, pred.output_bytes, pred.alias_bytes) == \
        (ref.argument_bytes, ref.output_bytes, ref.alias_bytes)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= tolerance


def test_gather_feeding_a_batched_matvec_is_fused_and_a_log_softmax_result_is_stored():
    import jax

    from jaxmem.compiler import planner
    from jaxmem.compiler.fusion import forced_fusion
    from jaxmem.compiler.program import drop_dead

    def decisions(name, primitive):
        _, factory = _load(name)
        fn, args = factory()
        g = drop_dead(ja.inline(jax.make_jaxpr(fn)(*args)))
        roles = planner.value_roles(g, [False] * len(g.invars), (), ())
        fused = gpu_fusion(g, roles, forced_fusion(g, roles))
        return [fused[op.outputs[0]] for op in g.ops if op.primitive == primitive]

    assert decisions("gather_into_matvec", "gather") == [True]
    assert decisions("relu_into_gemm", "max") == [True]
    assert decisions("log_softmax_rows", "sub")[-1] is False   # logp, read by the gather


FAST = [("mlp_forward", ()), ("mlp_train", (0, 1)), ("transformer_forward", ()), ("cnn_forward", ()),
        ("while_cond", ()), ("rnn_scan_grad", ())]


@needs_gpu_compiler
@pytest.mark.parametrize("device", ["h100-80gb", "a100-40gb"])
@pytest.mark.parametrize("name,donate", FAST)
def test_prediction_within_5_percent_on_fast_suite_programs(name, donate, device):
    from jaxmem.examples.suite import ALL_PROGRAMS

    program = ALL_PROGRAMS[name]
    ref = xla_gpu_reference(program.target, device=device, donate_argnums=donate, top=0)
    pred = _predict(*program.factory(), donate=donate, device=device)
    assert abs(pred.total_bytes / ref.total_bytes - 1) <= 0.05, (pred.total_bytes, ref.total_bytes)


# Measured outside 5% (BENCHMARKS.md, "How close is jaxmem's model of XLA:GPU?"): the rules these miss are listed there.
OUTSIDE = {"moe_train"}  # on A100 (0.949): XLA's memory scheduler picks post order there


@pytest.mark.slow
@pytest.mark.exhaustive  # 42 deviceless compiles, about 12 minutes here: `pytest -m exhaustive`
@needs_gpu_compiler
@pytest.mark.parametrize("device", ["h100-80gb", "a100-40gb"])
def test_prediction_within_5_percent_on_every_suite_program(device):
    from jaxmem.examples.suite import ALL_PROGRAMS

    outside = {}
    for name, program in ALL_PROGRAMS.items():
        ref = xla_gpu_reference(program.target, device=device, donate_argnums=program.donate_argnums, top=0)
        pred = _predict(*program.factory(), donate=program.donate_argnums, device=device)
        ratio = pred.total_bytes / ref.total_bytes
        if abs(ratio - 1) > 0.05:
            outside[name] = round(ratio, 3)
    assert set(outside) <= OUTSIDE, outside


@needs_gpu_compiler
def test_gpu_plan_of_moe_is_checked_runs_on_the_host_and_stays_below_xla_gpu(capsys):
    from jaxmem.cli.main import main as cli_main

    assert cli_main(["analyze", "jaxmem.examples.zoo:moe_train", "--device", "h100-80gb", "--donate", "0,1",
                     "--execute", "--json", "--xla", "gpu"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["valid"] and data["execute"]["ok"]
    gpu_total = data["xla_gpu"]["total_bytes"]
    assert data["peak_bytes"] <= gpu_total            # the CPU model's plan was 7.8x of it
    assert abs(data["predicted_xla_bytes"] / gpu_total - 1) <= 0.15
    assert data["predicted_xla"]["total_bytes"] == data["predicted_xla_bytes"]


def test_plan_on_gpu_keeps_the_lower_checked_plan():
    from jaxmem.compiler.planner import plan
    from jaxmem.examples.suite import ALL_PROGRAMS

    fn, args = ALL_PROGRAMS["moe_train"].factory()
    cpu = plan(fn, *args, donate_argnums=(0, 1), xla=False)
    gpu = plan_on_gpu(cpu)
    assert gpu.valid and gpu.peak_bytes <= cpu.peak_bytes and gpu.peak_bytes < cpu.peak_bytes / 4


# --- pred1: cross-entropy gradient in place, gelu outputs per device

@needs_gpu_compiler
@pytest.mark.parametrize("device", ["h100-80gb", "a100-40gb"])
def test_cross_entropy_gradient_takes_a_dying_operands_buffer(device):
    module, factory = _load("cross_entropy_gradient_in_place")
    ref = xla_gpu_reference(f"{FUSION}:cross_entropy_gradient_in_place", device=device, top=0)
    pred = _predict(*factory(), device=device)
    big = module.BIG
    # logp and the scatter, the gradient written over one of them: 2 buffers of 16 MiB, not 3
    assert math.floor(pred.temp_bytes / big) == math.floor(ref.temp_bytes / big) == 2, (pred.temp_bytes,
                                                                                          ref.temp_bytes)


# --- pred2: moe, heap placement, split-K

# Rule programs checked on both devices: name -> donate_argnums.
PRED2_RULES = {"scatter_into_donated_output": (0,), "relu_mask_read_by_gemms": ()}


@needs_gpu_compiler
@pytest.mark.parametrize("device", ["h100-80gb", "a100-40gb"])
@pytest.mark.parametrize("name", sorted(PRED2_RULES))
def test_each_pred2_rule_matches_xla_gpu_buffer_assignment(name, device):
    _rule_matches_xla(name, device, PRED2_RULES[name], 0.05)


@needs_gpu_compiler
def test_heap_placement_reproduces_xla_gpu_offsets_of_its_own_temporaries(tmp_path):
    """XLA's temporaries (its own live ranges and value ids, from moe_train's dumps) placed by
    `xla.gpu.model.heap_simulator`: the spatial placement puts every buffer of 1 KiB or more at XLA's offset, and
    the heap is XLA's temp allocation (the rest: 16-24 byte tuple tables)."""
    import subprocess
    import sys

    from jaxmem.xla.gpu.compile import _dump_files, child_env
    from jaxmem.xla.gpu.model.heap_simulator import dump_temp_spans, placements, xla_heap_size

    subprocess.run([sys.executable, "-m", "jaxmem.xla.gpu", "jaxmem.examples.zoo:moe_train", "--spec", "h100_sxm",
                    "--device", "h100-80gb", "--donate", "0,1", "--no-cache", "--top", "0"],
                   env=child_env(str(tmp_path)), check=True, capture_output=True, timeout=600)
    live_path, _, assignment_path = _dump_files(str(tmp_path))
    spans, offsets, ids, temp = dump_temp_spans(Path(assignment_path).read_text(), Path(live_path).read_text())
    assert len(spans) > 10 and temp > 0
    aligned = [(s, e, -(-z // 256) * 256) for s, e, z in spans]
    placed, _ = placements(aligned, ids)["spatial"]
    big = [k for k, (_, _, z) in enumerate(spans) if z >= 1024]
    assert len(big) > 10
    assert [placed[k] for k in big] == [offsets[k] for k in big]
    assert abs(xla_heap_size(aligned) - temp) <= 4096


def test_heap_placement_is_valid_and_never_below_the_live_bound():
    """Invariants of `xla.gpu.model.heap_simulator` on random heaps: no two buffers live at once share bytes, the
    heap holds every buffer, and no placement beats the most bytes live at once."""
    import random

    from jaxmem.compiler.stages import live_profile
    from jaxmem.xla.gpu.model.heap_simulator import placements, xla_heap_size

    rng = random.Random(7)
    for _ in range(200):
        spans = []
        for _ in range(rng.randint(1, 30)):
            s = rng.randint(0, 40)
            spans.append((s, s + rng.randint(0, 15), 256 * rng.randint(1, 64)))
        bound = int(live_profile(spans, max(e for _, e, _ in spans)).max())
        for offsets, size in placements(spans).values():
            assert size >= bound
            for i, (s1, e1, z1) in enumerate(spans):
                assert offsets[i] + z1 <= size
                for j in range(i):
                    s2, e2, z2 = spans[j]
                    if s1 <= e2 and s2 <= e1:
                        assert offsets[i] + z1 <= offsets[j] or offsets[j] + z2 <= offsets[i]
        assert xla_heap_size(spans) == min(size for _, size in placements(spans).values())


@needs_gpu_compiler
@pytest.mark.parametrize("device", ["h100-80gb", "a100-40gb"])
@pytest.mark.parametrize("name", ["gelu_step", "gelu_step_bf16", "silu_step"])
def test_transcendental_stored_or_recomputed_per_device_as_xla_gpu(name, device):
    import re

    import jax

    from jaxmem.compiler import planner
    from jaxmem.compiler.fusion import forced_fusion

    module, factory = _load(name)
    ref = xla_gpu_reference(f"{FUSION}:{name}", device=device, top=10)
    # XLA stores the transcendental as the second output of the activation's loop fusion
    # (`loop_multiply_tanh_fusion{1}`); recomputed, no second output is held at the peak.
    xla_stored = any(re.search(r"^loop_\w*fusion(\.\d+)?\{1\}$", b["name"]) and b["kind"] == "temporary"
                     for b in ref.peak_buffers)
    assert xla_stored == module.TRANSCENDENTAL_STORED[(name, device)]
    fn, args = factory()
    g = planner.inlined(jax.make_jaxpr(fn)(*args))
    roles = planner.value_roles(g, [False] * len(g.invars), (), ())
    fused = gpu_fusion(g, roles, forced_fusion(g, roles), store_shared_casts=True, device=device)
    stored = [not fused[op.outputs[0]] for op in g.ops if op.primitive in ("tanh", "logistic")]
    assert stored == [xla_stored]
