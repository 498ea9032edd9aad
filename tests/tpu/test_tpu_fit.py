"""fit, optimize and --compare-shardings judged by XLA:TPU on a TPU preset."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from jaxmem.cli.main import main as cli_main
from jaxmem.xla.tpu.compile import DEVICELESS_ENV

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.usefixtures("needs_libtpu")
def test_judge_on_a_tpu_preset_is_xla_tpu_s_own_figures():
    """fit's and optimize's judge compiles in its own process (deviceless, JAX on the CPU): its
    figures are the child compile's, which the chip tests hold equal to a v5e's."""
    script = (
        "import sys; sys.path.insert(0, %r)\n"
        "from tpu_programs import narrow_columns\n"
        "from jaxmem.fitting.judge import Judge\n"
        "from jaxmem.xla.tpu.compile import xla_tpu_reference\n"
        "fn, args = narrow_columns()\n"
        "judge = Judge('tpu-v5e-16gb')\n"
        "f = judge.figures(fn, args, ())\n"
        "ref = xla_tpu_reference(%r + ':narrow_columns', 'tpu-v5e-16gb', top=0)\n"
        "print(judge.name, f.argument, f.output, f.temp, f.alias, f.total == ref.total_bytes,\n"
        "      (f.argument, f.output, f.temp, f.alias) == (ref.argument_bytes, ref.output_bytes, ref.temp_bytes, ref.alias_bytes))\n"
    ) % (HERE, os.path.join(HERE, "tpu_programs.py"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", **DEVICELESS_ENV}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    words = done.stdout.split()
    assert words[:2] == ["XLA:TPU", "tpu-v5e-16gb"], done.stderr[-2000:]
    # f32[4096, 3] and f32[3, 5] in XLA:TPU's tiled layouts: more than their 49,212 B of elements.
    assert int(words[2]) > 4096 * 3 * 4 + 3 * 5 * 4
    assert words[-2:] == ["True", "True"]


@pytest.mark.slow
@pytest.mark.usefixtures("needs_libtpu")
def test_fit_on_a_tpu_preset_says_xla_tpu_s_floor(capsys):
    code = cli_main(["fit", "jaxmem.examples.suite:transformer_train", "--donate", "0,1", "--device", "tpu-v5e-16gb",
                     "--budget", "90%", "--no-time", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["fits"] is False
    assert "XLA:TPU tpu-v5e-16gb" in json.dumps(data)


@pytest.mark.slow  # tens of seconds of XLA compiles; in the slow pass
@pytest.mark.usefixtures("needs_libtpu")
def test_compare_shardings_on_a_v5e_slice(capsys):
    code = cli_main(["analyze", "jaxmem.examples.suite:transformer_train", "--device", "tpu-v5e-16gb",
                     "--compare-shardings", "--mesh", "4", "--json"])
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads(out)
    rows = {row["layout"]: row for row in data["layouts"]}
    assert set(rows) == {"dp", "fsdp"}
    for row in rows.values():
        assert row["devices"] == 4 and row["xla_tpu"]["topology"] == "v5e:2x2" and row["pool"]["rules"] == "tpu_runtime"
    # Sharding the state over 4 chips holds less of it on each than replicating it.
    assert rows["fsdp"]["xla_tpu"]["argument_bytes"] < rows["dp"]["xla_tpu"]["argument_bytes"]
