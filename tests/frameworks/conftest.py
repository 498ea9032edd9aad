"""The framework steps (`benchmarks/framework_steps`: an evaluation set and a tuning set) and
the recording of what a TPU v5e did with them (`benchmarks/results/tpu_v5e_frameworks.jsonl`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STEPS = ROOT / "benchmarks" / "framework_steps"
sys.path.insert(0, str(STEPS))
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("KERAS_BACKEND", "jax")


@pytest.fixture(scope="session")
def tpu_cache_dir_session(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jaxmem-framework-cache"))


@pytest.fixture(autouse=True)
def _cache(tpu_cache_dir_session, monkeypatch):
    monkeypatch.setenv("JAXMEM_CACHE_DIR", tpu_cache_dir_session)


@pytest.fixture
def needs_libtpu():
    from jaxmem.xla.tpu.compile import unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"deviceless XLA:TPU compiles cannot run here: {reason}")
