"""`jaxmem analyze` and `jaxmem maxbatch` on TPU presets: XLA:TPU's figures in the JSON, the
TPU runtime's verdict, an over-HBM program as a verdict, sharded programs per chip, and bad
input in one line."""

from __future__ import annotations

import json
import os

import pytest

from jaxmem.cli.main import main as cli_main
from jaxmem.runtime.tpu_pool import RUNTIME_BYTES

HERE = os.path.dirname(os.path.abspath(__file__))
PROGRAMS = os.path.join(HERE, "tpu_programs.py")
XLA_TPU_KEYS = {"argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes", "total_bytes",
                "target", "compile_seconds"}


def _run(argv, capsys):
    code = cli_main(argv)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.usefixtures("needs_libtpu")
def test_analyze_reports_xla_tpu_and_the_runtime_verdict(capsys):
    code, out, err = _run(["analyze", f"{PROGRAMS}:rows_step", "--device", "tpu-v5e-16gb", "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    xla = data["xla_tpu"]
    assert XLA_TPU_KEYS <= set(xla) and xla["target"] == "tpu-v5e-16gb" and data["xla_gpu"] is None
    assert xla["total_bytes"] == xla["argument_bytes"] + xla["output_bytes"] + xla["temp_bytes"] - xla["alias_bytes"]
    # 4 MiB of state donated and written in place: XLA:TPU's own arithmetic, checked by hand.
    assert xla["argument_bytes"] == 4 << 20 and xla["alias_bytes"] == 4 << 20
    pool = data["pool"]
    assert pool["judged_on"] == "xla_tpu" and pool["rules"] == "tpu_runtime" and pool["fits"]
    fresh = xla["output_bytes"] - xla["alias_bytes"]
    # Runtime buffer + state + code resident; the step's loss and tuple table, the last loss kept.
    assert pool["peak_bytes"] == RUNTIME_BYTES + xla["argument_bytes"] + xla["generated_code_bytes"] + 2 * fresh \
        + pool["reserved_bytes"]
    assert data["device"]["pool_rules"] == "tpu_runtime" and data["device"]["usable_bytes"] == 16_909_336_064


@pytest.mark.usefixtures("needs_libtpu")
def test_a_program_over_the_chip_is_a_verdict_not_an_error(capsys):
    code, out, err = _run(["analyze", f"{PROGRAMS}:over_hbm", "--device", "tpu-v5e-16gb", "--json", "--no-xla"],
                          capsys)
    assert code == 0 and json.loads(out)["xla_tpu"] is None   # --no-xla: no compile at all
    code, out, err = _run(["analyze", f"{PROGRAMS}:over_hbm", "--device", "tpu-v5e-16gb", "--json", "--xla", "tpu"],
                          capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["fits"] is False and data["pool"]["fits"] is False
    assert data["xla_tpu"]["oom"].startswith("RESOURCE_EXHAUSTED: Ran out of memory on HBM")
    assert "exceeds available HBM (15.75G)" in data["pool"]["message"]


@pytest.mark.usefixtures("needs_libtpu")
def test_table_and_report_name_xla_tpu_and_the_tpu_rules(capsys, tmp_path):
    html = tmp_path / "report.html"
    code, out, err = _run(["analyze", f"{PROGRAMS}:narrow_columns", "--device", "tpu-v5e-16gb", "--html", str(html)],
                          capsys)
    assert code == 0, err
    assert "XLA:TPU tpu-v5e-16gb" in out and "TPU runtime: no preallocation" in out
    assert "JAX preallocates" not in out
    page = html.read_text(encoding="utf-8")
    assert "XLA:TPU total (tpu-v5e-16gb)" in page and "chip over 3 steps" in page


def test_gpu_client_flags_on_a_tpu_are_one_line(capsys):
    code, out, err = _run(["analyze", f"{PROGRAMS}:rows_step", "--device", "tpu-v5e-16gb", "--mem-fraction", ".5",
                           "--xla", "cpu"], capsys)
    assert code == 2 and err.count("\n") == 1 and "JAX's TPU runtime does not read" in err


def test_missing_libtpu_is_one_line_and_xla_cpu_judges(capsys, monkeypatch, tmp_path):
    import importlib.util

    from jaxmem.xla.compilers import jax_versions

    monkeypatch.setenv("JAXMEM_HOME", str(tmp_path))   # no compilers folder
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a))
    code, out, err = _run(["analyze", f"{PROGRAMS}:rows_step", "--device", "tpu-v5e-16gb", "--json"], capsys)
    assert code == 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"jaxmem analyze: XLA:TPU is not available here (the XLA:TPU compiler for JAX "
                     f"{jax_versions()[0]} is not installed: run `jaxmem compilers install`); comparing with XLA:CPU"]
    data = json.loads(out)
    assert data["xla_tpu"] is None and data["pool"]["judged_on"] == "xla_cpu" and data["pool"]["rules"] == "tpu_runtime"
    code, out, err = _run(["maxbatch", f"{PROGRAMS}:rows_step", "--arg", "rows", "--device", "tpu-v5e-16gb"], capsys)
    assert code == 2 and err.count("\n") == 1 and "maxbatch needs XLA:TPU" in err
    code, out, err = _run(["analyze", f"{PROGRAMS}:rows_step", "--device", "tpu-v5e-16gb", "--xla", "tpu"], capsys)
    assert code == 2 and err.count("\n") == 1 and "--xla tpu: XLA:TPU is not available here: the XLA:TPU compiler" in err


@pytest.mark.usefixtures("needs_libtpu")
def test_libtpu_of_another_version_is_one_line(capsys, monkeypatch):
    from jaxmem.xla import compilers
    from jaxmem.xla.tpu.compile import unavailable_reason

    monkeypatch.setattr(compilers, "installed_version", lambda kind: "0.0.50")
    assert unavailable_reason() == (f"libtpu 0.0.50 is installed, and JAX {compilers.jax_versions()[0]} needs "
                                    f"libtpu=={compilers.required_libtpu()}: run `jaxmem compilers install`")
    code, out, err = _run(["maxbatch", f"{PROGRAMS}:rows_step", "--arg", "rows", "--device", "tpu-v5e-16gb"], capsys)
    assert code == 2 and err.count("\n") == 1 and "libtpu 0.0.50 is installed" in err


@pytest.mark.usefixtures("needs_libtpu")
@pytest.mark.parametrize("argv, message", [
    (["--topology", "v5e:abc"], "unknown TPU topology 'v5e:abc'"),
    (["--mesh", "16", "--layout", "fsdp", "--topology", "v5e:2x4"], "the mesh has 16 devices and topology v5e:2x4 8"),
    (["--topology", "v4:2x2x1"], "topology v4:2x2x1 is of v4 chips, and tpu-v5e-16gb is a v5e"),
])
def test_bad_topologies_are_one_line(argv, message, capsys):
    code, out, err = _run(["analyze", "jaxmem.examples.sharded:fsdp_step", "--device", "tpu-v5e-16gb", *argv], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err


@pytest.mark.usefixtures("needs_libtpu")
def test_a_sharded_step_per_chip_on_a_v5e_slice(capsys):
    import jax

    from jaxmem.compiler.jaxpr_adapter import aval_bytes
    from jaxmem.compiler.target import load_target

    code, out, err = _run(["analyze", "jaxmem.examples.sharded:fsdp_step", "--device", "tpu-v5e-16gb", "--json"],
                          capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["devices"] == 8 and data["xla_tpu"]["topology"] == "v5e:2x4"
    assert data["pool"]["rules"] == "tpu_runtime" and data["pool"]["fits"]
    _, args = load_target("jaxmem.examples.sharded:fsdp_step")
    whole = sum(aval_bytes(leaf) for leaf in jax.tree.leaves(args))
    # FSDP over 8 chips: each holds an eighth of the state, padded to its tiles, not the whole.
    assert whole / 8 <= data["xla_tpu"]["argument_bytes"] < whole / 4


@pytest.mark.usefixtures("needs_libtpu")
def test_maxbatch_finds_the_boundary_the_rules_give(capsys):
    from jaxmem.accelerators import resolve
    from jaxmem.xla.tpu.compile import xla_tpu_reference

    code, out, err = _run(["maxbatch", f"{PROGRAMS}:rows_step", "--arg", "rows", "--device", "tpu-v5e-16gb", "--json",
                           "--min", "1024"], capsys)
    assert code == 0, err
    data = json.loads(out)
    value = data["value"]
    limit = resolve("tpu-v5e-16gb").capacity_bytes
    assert data["limit_bytes"] == limit and not data["at_maximum"]

    def need(rows: int) -> int | None:   # the TPU runtime's rules by hand, on XLA:TPU's figures at `rows`
        ref = xla_tpu_reference(f"{PROGRAMS}:rows_step", "tpu-v5e-16gb", kwargs={"rows": rows}, top=0,
                                donate_argnums=(0,))
        if ref.oom:
            return None   # XLA:TPU itself refuses it
        fresh = ref.output_bytes - ref.alias_bytes
        return RUNTIME_BYTES + ref.argument_bytes + ref.generated_code_bytes + 2 * fresh + (ref.reserved_bytes or 0)

    fits = need(value)
    assert fits is not None and fits <= limit
    after = need(value + 1)
    assert after is None or after > limit
    # 1 MiB of state per row, written in place: the chip's memory in MiB, less a little for the
    # runtime's buffer, the program's code and the loss.
    assert (limit - RUNTIME_BYTES) // (1 << 20) - 4 <= value <= (limit - RUNTIME_BYTES) // (1 << 20)


@pytest.mark.slow
@pytest.mark.usefixtures("needs_libtpu")
def test_maxbatch_of_the_gpt_example_is_what_the_chip_ran(capsys):
    """The chip ran batch 17 for 3 steps and refused 18 at compile, parameters and optimizer
    state donated (benchmarks/results/tpu_v5e_chip_maxbatch.jsonl)."""
    from jaxmem.xla.tpu.chip import read_recording

    chip = {row["batch_size"]: row["ok"] for row in read_recording(
        os.path.join(HERE, "..", "..", "benchmarks", "results", "tpu_v5e_chip_maxbatch.jsonl"))}
    assert chip == {16: True, 17: True, 18: False, 19: False}
    code, out, err = _run(["maxbatch", "jaxmem.examples.gpt:batch_example", "--arg", "batch_size", "--device",
                           "tpu-v5e-16gb", "--donate", "0,1", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["value"] == 17
