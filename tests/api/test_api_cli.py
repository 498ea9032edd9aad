"""`jaxmem.analyze(...).to_dict()` is what `jaxmem analyze TARGET --json` prints (timings and
the cache flag left out): the command is a thin layer over the function."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jaxmem
from jaxmem.api.result import without_timings
from jaxmem.compiler.target import load_target
from jaxmem.xla.gpu.compile import unavailable_reason as gpu_reason
from jaxmem.xla.tpu.compile import unavailable_reason as tpu_reason

HERE = os.path.dirname(__file__)
PROGRAMS = [
    pytest.param(f"{HERE}/api_programs.py:abstract_sgd", "h100-80gb", (0,), id="sgd-h100"),
    pytest.param(f"{HERE}/api_programs.py:abstract_sgd", "tpu-v5e-16gb", (0,), id="sgd-v5e"),
    pytest.param("jaxmem.examples.suite:mlp_train", "h100-80gb", (0, 1), id="mlp-h100", marks=pytest.mark.slow),
    pytest.param("jaxmem.examples.suite:cnn_train", "a100-40gb", (0, 1), id="cnn-a100", marks=pytest.mark.slow),
    pytest.param("jaxmem.examples.suite:rnn_scan_grad", "h100-80gb", (), id="rnn-h100", marks=pytest.mark.slow),
    pytest.param(f"{HERE}/api_programs.py:abstract_jitted_sgd", "tpu-v5e-16gb", None, id="jitted-v5e",
                 marks=pytest.mark.slow),
    pytest.param("jaxmem.examples.suite:while_cond", "a100-40gb", (), id="while-a100", marks=pytest.mark.slow),
]


def cli_json(target: str, device: str, donate: tuple[int, ...] | None) -> dict:
    cmd = [sys.executable, "-m", "jaxmem", "analyze", target, "--device", device, "--json"]
    if donate:
        cmd += ["--donate", ",".join(map(str, donate))]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("target, device, donate", PROGRAMS)
def test_to_dict_is_the_commands_json(target, device, donate):
    if (tpu_reason() if device.startswith("tpu") else gpu_reason()):
        pytest.skip("the device's compiler is not installed here")
    command = cli_json(target, device, donate)
    fn, args = load_target(target)
    result = jaxmem.analyze(fn, *args, device=device, donate=donate, quiet=True).to_dict()
    assert command.pop("target") == target
    assert result.pop("target") == getattr(fn, "__name__", None) or result
    assert without_timings(result) == without_timings(command)
    assert result["xla_gpu" if device.startswith(("h100", "a100")) else "xla_tpu"]["total_bytes"] > 0
