"""GPU preflight: XLA:GPU's figures (deviceless) against an independent compile, the cache, what
XLA:GPU holds at its peak, the pool over steps, maxbatch, and abstract (ShapeDtypeStruct) programs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxmem.cli.main import main as cli_main
from jaxmem.runtime.device import Device
from jaxmem.runtime.steps import Leaf, StepProgram, match_state, program_from_reference, simulate_steps
from jaxmem.units import MiB, PRESETS
from jaxmem.xla.gpu import compile as xla_gpu
from jaxmem.xla.gpu.compile import GPU_TARGETS, cache_read, unavailable_reason, xla_gpu_reference
from jaxmem.xla.start import filter_noise

from gpu_test_support import needs_gpu_compiler

HERE = Path(__file__).resolve().parent
PROGRAMS = str(HERE / "gpu_programs.py")

# An independent deviceless compile, through JAX's APIs directly, in a fresh process.
INDEPENDENT = textwrap.dedent("""
    import json, os, sys
    os.environ["JAX_PLATFORMS"] = "cpu"
    import importlib.util, jax
    from jax.experimental import topologies
    from jax.sharding import NamedSharding, PartitionSpec
    spec_path, programs_path, requests, capacity = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
    # The preset's capacity as the device's memory, as jaxmem gives it to XLA.
    lines = [("  device_memory_size: " + capacity) if l.strip().startswith("device_memory_size:") else l
             for l in open(spec_path).read().splitlines()]
    topo = topologies.get_topology_desc(platform="cuda", target_config=chr(10).join(lines), topology="1x1x1")
    sharding = NamedSharding(topologies.make_mesh(topo, (1,), ("x",)), PartitionSpec())
    module_spec = importlib.util.spec_from_file_location("progs", programs_path)
    progs = importlib.util.module_from_spec(module_spec); module_spec.loader.exec_module(progs)
    out = []
    for name, kwargs, donate in requests:
        fn, args = getattr(progs, name)(**kwargs)
        structs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), args)
        m = jax.jit(fn, donate_argnums=tuple(donate)).trace(*structs).lower().compile().memory_analysis()
        out.append([m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes, m.alias_size_in_bytes])
    print(json.dumps(out))
""")


def independent(preset: str, requests: list) -> list[list[int]]:
    """[argument, output, temp, alias] bytes per (factory name, kwargs, donate) request, compiled
    for the preset's XLA target description with the preset's capacity."""
    spec_path = Path(xla_gpu.__file__).parent / "targets" / f"{GPU_TARGETS[preset]}.txtpb"
    proc = subprocess.run([sys.executable, "-c", INDEPENDENT, str(spec_path), PROGRAMS, json.dumps(requests),
                           str(PRESETS[preset])],
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def figures(ref) -> list[int]:
    return [ref.argument_bytes, ref.output_bytes, ref.temp_bytes, ref.alias_bytes]


@pytest.fixture(scope="session")
def mlp_refs():
    """jaxmem's XLA:GPU figures for two small programs on H100 and A100 (compiled, not cached)."""
    return {
        ("mlp_step", "h100-80gb"): xla_gpu_reference(f"{PROGRAMS}:mlp_step", device="h100-80gb", use_cache=False),
        ("mlp_step", "a100-40gb"): xla_gpu_reference(f"{PROGRAMS}:mlp_step", device="a100-40gb", use_cache=False),
        ("abstract_mlp_step", "h100-80gb"): xla_gpu_reference(f"{PROGRAMS}:abstract_mlp_step", device="h100-80gb",
                                                              donate_argnums=(0,)),
    }


# -- the reference --------------------------------------------------------------------------

@needs_gpu_compiler
def test_xla_gpu_figures_equal_an_independent_deviceless_compile_byte_for_byte(mlp_refs):
    h100 = independent("h100-80gb", [["mlp_step", {}, []], ["abstract_mlp_step", {}, [0]]])
    a100 = independent("a100-40gb", [["mlp_step", {}, []]])
    assert figures(mlp_refs[("mlp_step", "h100-80gb")]) == h100[0]
    assert figures(mlp_refs[("abstract_mlp_step", "h100-80gb")]) == h100[1]
    assert figures(mlp_refs[("mlp_step", "a100-40gb")]) == a100[0]
    donated = mlp_refs[("abstract_mlp_step", "h100-80gb")]
    assert donated.alias_bytes > 0 and all(a["donated"] for a in donated.arguments[:2])
    ref = mlp_refs[("mlp_step", "h100-80gb")]
    assert ref.total_bytes == sum(h100[0][:3]) - h100[0][3] and ref.compile_seconds > 0
    assert ref.summary()["target"] == "h100-80gb" and ref.spec == "h100_sxm"


@needs_gpu_compiler
def test_xla_gpu_peak_buffers_carry_sizes_arguments_and_source_lines(mlp_refs):
    ref = mlp_refs[("mlp_step", "h100-80gb")]
    sizes = [r["size_bytes"] for r in ref.peak_buffers]
    assert sizes and sizes == sorted(sizes, reverse=True) and sum(sizes) <= ref.peak_live_bytes <= ref.total_bytes
    params = [r for r in ref.peak_buffers if r["kind"] == "argument"]
    assert {r["op_name"] for r in params} >= {"params['w1']", "params['w2']"}
    temps = [r for r in ref.peak_buffers if r["kind"] == "temporary"]
    assert temps and all("gpu_programs.py:" in r["source"] for r in temps if r["source"])
    assert any(r["source"] for r in temps)


@needs_gpu_compiler
def test_cache_hits_and_a_corrupt_entry_is_ignored(mlp_refs, gpu_cache_dir):
    first = mlp_refs[("abstract_mlp_step", "h100-80gb")]
    again = xla_gpu_reference(f"{PROGRAMS}:abstract_mlp_step", device="h100-80gb", donate_argnums=(0,))
    assert again.cached and figures(again) == figures(first) and again.key == first.key
    path = Path(gpu_cache_dir) / f"{first.key}.json"
    path.write_text('{"key": "' + first.key + '", "argument_bytes": "garbage"')
    assert cache_read(gpu_cache_dir, first.key) is None
    fresh = xla_gpu_reference(f"{PROGRAMS}:abstract_mlp_step", device="h100-80gb", donate_argnums=(0,))
    assert not fresh.cached and figures(fresh) == figures(first)
    assert cache_read(gpu_cache_dir, first.key) is not None    # rewritten


def test_every_gpu_preset_has_a_target_description():
    for preset, spec in GPU_TARGETS.items():
        assert preset in PRESETS
        text = xla_gpu.with_memory(xla_gpu.target_config(spec), PRESETS[preset])
        assert "gpu_device_info" in text and f"device_memory_size: {PRESETS[preset]}" in text
    assert xla_gpu.spec_for("tpu-v5e-16gb") is None


def test_noise_filter_keeps_other_lines():
    text = ("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n"
            "I0000 00:00 cudart_stub.cc:31] Could not find cuda drivers on your machine\nerror: real\n")
    assert filter_noise(text) == "error: real\n"


# -- the pool ---------------------------------------------------------------------------------

@needs_gpu_compiler
def test_pool_second_step_fails_for_fragmentation_though_xla_total_fits():
    ref = xla_gpu_reference(f"{PROGRAMS}:fragmenting_step", device="h100-80gb")
    program = program_from_reference(ref)
    assert [o.state_of for o in program.outputs] == [0, 2, 1]
    limit = ref.total_bytes                       # XLA's total fits exactly
    verdict = simulate_steps(program, Device(limit, mem_fraction=1.0), steps=3)
    assert ref.total_bytes <= verdict.limit_bytes
    assert not verdict.fits and verdict.failed_step == 2 and verdict.fragmentation
    assert verdict.failed_allocation == "the temp allocation" and verdict.failed_bytes == ref.temp_bytes
    assert simulate_steps(program, Device(limit + 16 * MiB, mem_fraction=1.0), steps=3).fits


def test_pool_donated_state_reuses_its_buffers():
    program = StepProgram([Leaf(8 * MiB, donated=True), Leaf(MiB)],
                          match_state([Leaf(8 * MiB, donated=True), Leaf(MiB)], [Leaf(8 * MiB, aliases=0), Leaf(4)]),
                          temp_bytes=2 * MiB)
    verdict = simulate_steps(program, Device(64 * MiB, mem_fraction=1.0), steps=5)
    assert verdict.fits and verdict.steps == 5 and verdict.failed_step is None
    assert verdict.peak_bytes < 12 * MiB


@needs_gpu_compiler
def test_analyze_fails_at_75_percent_and_fits_at_95_with_an_abstract_64gib_program(capsys, monkeypatch):
    target = f"{PROGRAMS}:abstract_resident_64gib"
    monkeypatch.delenv("XLA_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert cli_main(["analyze", target, "--donate", "0", "--device", "h100-80gb", "--json", "--top", "3"]) == 0
    default = json.loads(capsys.readouterr().out)
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", ".95")
    assert cli_main(["analyze", target, "--donate", "0", "--device", "h100-80gb", "--json", "--top", "3"]) == 0
    raised = json.loads(capsys.readouterr().out)
    total = default["xla_gpu"]["total_bytes"]
    assert 0.75 * PRESETS["h100-80gb"] < total < 0.95 * PRESETS["h100-80gb"]
    assert default["argument_bytes"] == 64 << 30
    assert default["pool"]["fits"] is False and default["pool"]["failed_step"] is not None and default["fits"] is False
    assert default["pool"]["limit_bytes"] == int(0.75 * PRESETS["h100-80gb"])
    assert raised["pool"]["fits"] is True and raised["pool"]["failed_step"] is None and raised["fits"] is True
    assert raised["pool"]["limit_bytes"] == int(0.95 * PRESETS["h100-80gb"])
    assert raised["xla_gpu"]["total_bytes"] == total and raised["xla_gpu"]["cached"] is True
    # The updated blocks are written in place of the donated ones: held once at XLA's peak.
    assert default["xla_gpu_peak_live_bytes"] <= total
    assert [r["kind"] for r in default["xla_gpu_peak_buffers"]] == ["argument"] * 3
    # The flag overrides the environment.
    assert cli_main(["analyze", target, "--donate", "0", "--json", "--mem-fraction", "0.75", "--xla", "gpu"]) == 0
    assert json.loads(capsys.readouterr().out)["pool"]["fits"] is False


# -- analyze's reports ---------------------------------------------------------------------------

@needs_gpu_compiler
def test_analyze_json_text_and_html_show_xla_gpu_and_its_peak(tmp_path, capsys, mlp_refs, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    target = f"{PROGRAMS}:mlp_step"
    html = tmp_path / "r.html"
    assert cli_main(["analyze", target, "--json", "--html", str(html)]) == 0
    data = json.loads(capsys.readouterr().out)
    ref = mlp_refs[("mlp_step", "h100-80gb")]
    assert set(data["xla_gpu"]) >= {"target", "argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                                    "total_bytes", "compile_seconds"}
    assert data["xla_gpu"]["total_bytes"] == ref.total_bytes and data["xla_gpu"]["target"] == "h100-80gb"
    assert set(data["pool"]) >= {"fits", "limit_bytes", "peak_bytes", "steps", "failed_step"}
    assert data["pool"]["fits"] and data["pool"]["steps"] == 3 and data["pool"]["failed_step"] is None
    rows = data["xla_gpu_peak_buffers"]
    assert rows and {r["jaxpr_array"] for r in rows if r["kind"] == "argument"} >= {"args[0]['w1']", "args[0]['w2']"}
    assert any(r["jaxpr_array"] == "dot_general" for r in rows if r["kind"] == "temporary")
    page = html.read_text()
    assert "What XLA:GPU holds at its peak" in page and "XLA:GPU total (h100-80gb)" in page
    assert cli_main(["analyze", target, "--steps", "2"]) == 0
    text = capsys.readouterr().out
    assert "XLA:GPU h100-80gb" in text and "What XLA:GPU holds at its peak" in text and "2 steps" in text


def test_analyze_falls_back_to_xla_cpu_in_one_line_when_gpu_is_unavailable(capsys, monkeypatch):
    monkeypatch.setattr(xla_gpu, "unavailable_reason", lambda: "the CUDA plugin is only published for Linux x86-64")
    assert cli_main(["analyze", f"{PROGRAMS}:tanh_matmul", "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    # XLA:CPU's figure is compared; the pool runs over the predicted XLA:GPU figures
    assert data["xla_gpu"] is None and data["xla"] is not None and data["pool"]["judged_on"] == "predicted_xla_gpu"
    assert data["pool"]["peak_bytes"] >= data["predicted_xla_bytes"]
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "XLA:GPU is not available here" in lines[0] and "XLA:CPU" in lines[0]


def test_analyze_bad_pool_flags_are_one_line_errors(capsys):
    assert cli_main(["analyze", f"{PROGRAMS}:tanh_matmul", "--no-xla", "--steps", "0"]) == 2
    assert cli_main(["analyze", f"{PROGRAMS}:tanh_matmul", "--no-xla", "--mem-fraction", "1.5"]) == 2
    assert cli_main(["analyze", f"{PROGRAMS}:tanh_matmul", "--xla", "gpu", "--device", "tpu-v5e-16gb"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 3 and "Traceback" not in err


# -- maxbatch -------------------------------------------------------------------------------------

@needs_gpu_compiler
def test_maxbatch_is_exact_against_independent_compiles(capsys):
    assert cli_main(["maxbatch", f"{PROGRAMS}:rows_step", "--arg", "rows", "--device", "v100-16gb",
                     "--donate", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"arg", "value", "total_bytes", "next_total_bytes", "limit_bytes", "seconds", "compiles"}
    value, limit = data["value"], data["limit_bytes"]
    assert data["arg"] == "rows" and limit == int(0.75 * PRESETS["v100-16gb"])
    at, after = independent("v100-16gb", [["rows_step", {"rows": value}, [0]], ["rows_step", {"rows": value + 1}, [0]]])
    total_at, total_after = sum(at[:3]) - at[3], sum(after[:3]) - after[3]
    assert (total_at, total_after) == (data["total_bytes"], data["next_total_bytes"])
    assert total_at <= limit < total_after
    assert value == limit // (48 * MiB)
    assert 1 <= data["compiles"] <= 6


def test_maxbatch_errors_are_one_line(capsys):
    assert cli_main(["maxbatch", f"{PROGRAMS}:rows_step", "--arg", "rows", "--device", "24GiB"]) == 2
    assert cli_main(["maxbatch", f"{PROGRAMS}:nope", "--arg", "rows"]) == 2
    assert cli_main(["maxbatch", f"{PROGRAMS}:rows_step", "--arg", "not a name"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 3 and "Traceback" not in err


def test_pool_device_follows_jax_environment_and_flags(monkeypatch):
    from jaxmem.runtime.steps import make_device

    dev = make_device("h100-80gb", {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_CLIENT_MEM_FRACTION": ".5"})
    assert dev.preallocate is False and dev.mem_fraction == 0.5
    assert dev.allocator.limit == int(0.5 * PRESETS["h100-80gb"])
    dev = make_device("h100-80gb", {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, mem_fraction=0.9)
    assert dev.allocator_name == "platform"
    dev = make_device("h100-80gb", {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".95"}, preallocate=False)
    assert dev.mem_fraction == 0.95 and dev.preallocate is False


def test_analyze_execute_refuses_abstract_arguments_in_one_line(capsys):
    assert cli_main(["analyze", f"{PROGRAMS}:abstract_mlp_step", "--no-xla", "--execute"]) == 2
    err = capsys.readouterr().err
    assert "ShapeDtypeStruct" in err and len(err.strip().splitlines()) == 1


def test_search_is_exact_on_monotone_judges_from_any_guess():
    import random

    from jaxmem.xla.maxbatch import Judgement, search

    rng = random.Random(0)
    for _ in range(300):
        base, slope = rng.randint(0, 10**6), rng.randint(1, 10**4)
        limit = rng.randint(base + slope, base + slope * 5000)
        wobble = rng.choice([0, slope // 3])
        def total(v):
            return base + slope * v + (v % 7) * wobble
        threshold = next((v - 1 for v in range(1, 6002) if total(v) > limit), 6001)
        if threshold == 0:
            continue
        calls = []
        def judge(v):
            calls.append(v)
            return Judgement(v, v <= threshold, total(v))
        result = search(judge, limit_bytes=limit, guess=rng.choice([None, 1, threshold // 2 + 1, 3 * threshold]),
                        maximum=6000)
        assert result.value == threshold or (result.at_maximum and threshold >= 6000)
        assert len(calls) == len(set(calls)) <= 40


def test_an_unmodelled_allocator_in_the_environment_skips_the_pool_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_ALLOCATOR", "cuda_async")
    target = f"{PROGRAMS}:tanh_matmul"
    assert cli_main(["analyze", target, "--xla", "cpu", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["pool"] is None
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "cuda_async" in lines[0] and "not simulated" in lines[0]
    assert cli_main(["analyze", target, "--xla", "cpu", "--json", "--allocator", "bfc"]) == 0
    assert json.loads(capsys.readouterr().out)["pool"]["allocator"] == "bfc"


def test_dump_and_header_parsers():
    text = ("allocation 0: size 8, parameter 0, shape |f32[2]| at ShapeIndex {}, maybe-live-out:\n"
            " value: <1 p.1 @0> (size=8,offset=0): f32[2]{0}\n"
            " value: <2 add.2 @0> (size=8,offset=0): f32[2]{0}\n"
            "allocation 1: size 24, preallocated-temp:\n"
            " value: <3 f{} @0> (size=16,offset=0): (f32[], s32[])\n"
            " value: <4 f{0} @0> (size=4,offset=16): f32[]\n"
            "allocation 2: size 64, preallocated-temp:\n"
            " value: <5 arg_tuple.1{2} (phi) @0> (size=64,offset=0): f32[16]{0}\n"
            " value: <6 dus.9 @0> (size=64,offset=0): f32[16]{0}\n")
    phis: set[str] = set()
    slices = xla_gpu.parse_assignment(text, phis)
    assert slices["p.1"][:3] == slices["add.2"][:3] == (0, 0, "argument")
    # a loop state's phi is the same buffer as the body's value written there
    assert slices["arg_tuple.1{2}"] == slices["dus.9"] == (2, 0, "temporary", "f32[16]") and phis == {"arg_tuple.1{2}"}
    assert slices["f{0}"] == (1, 16, "temporary", "f32[]") and slices["f{}"][3] == ""
    peak = xla_gpu.parse_peak("  Live ranges at 7 (peak):\n    add.2{}: 8 bytes (cumulative: 8 bytes)\n"
                              "    f{0}: 4 bytes (cumulative: 12 bytes)\n  Stack trace breakdown\n")
    assert peak == [("add.2", 8), ("f{0}", 4)]
    header = "HloModule m, input_output_alias={ {0}: (1, {}, may-alias), {2}: (0, {}, must-alias) }, x=1\nrest"
    assert xla_gpu.output_aliases(header) == {0: 1, 2: 0}
    assert xla_gpu.with_memory("gpu_device_info {\n  core_count: 1\n}", 5).count("device_memory_size: 5") == 1
