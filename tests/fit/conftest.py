"""Shared by the fit tests: a script run in a child process for XLA:GPU's deviceless compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Callable

import pytest


@pytest.fixture
def run_gpu_script() -> Callable[[str], dict[str, Any]]:
    """Runs `script` (its `{tests}` filled with this folder) in a child with JAX_PLATFORMS=cpu,
    where XLA:GPU compiles deviceless, and returns the last JSON line it printed; skips where the
    CUDA plugin cannot load."""
    from jaxmem.xla.gpu.compile import unavailable_reason

    if unavailable_reason():
        pytest.skip(unavailable_reason())

    def run(script: str) -> dict[str, Any]:
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        out = subprocess.run([sys.executable, "-c", script.format(tests=os.path.dirname(__file__))],
                             env=env, capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])

    return run
