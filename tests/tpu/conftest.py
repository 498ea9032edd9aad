"""Shared fixtures for the TPU tests: one cache folder for the session's deviceless XLA:TPU
compiles, and a skip (saying why) where libtpu cannot compile here."""

from __future__ import annotations

import pytest

from jaxmem.xla.tpu.compile import unavailable_reason


@pytest.fixture(scope="session")
def tpu_cache_path(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jaxmem-xla-tpu-cache"))


@pytest.fixture(autouse=True)
def tpu_cache_dir(tpu_cache_path, monkeypatch):
    """Every deviceless compile of these tests caches into one fresh folder for the session, set
    per test (and undone after it), so that another folder's session-wide cache setting (the GPU
    tests') is never overridden in a worker that runs both."""
    monkeypatch.setenv("JAXMEM_CACHE_DIR", tpu_cache_path)
    return tpu_cache_path


@pytest.fixture
def needs_libtpu():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"deviceless XLA:TPU compiles cannot run here: {reason}")
