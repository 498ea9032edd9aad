"""Shared fixtures for the TPU tests: one cache folder for the session's deviceless XLA:TPU
compiles, and a skip (saying why) where libtpu cannot compile here."""

from __future__ import annotations

import pytest

from jaxmem.xla.tpu import unavailable_reason


@pytest.fixture(scope="session", autouse=True)
def tpu_cache_dir(tmp_path_factory):
    """Every deviceless compile of this session caches into a fresh folder."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("jaxmem-xla-tpu-cache")
    mp.setenv("JAXMEM_CACHE_DIR", str(path))
    yield str(path)
    mp.undo()


@pytest.fixture
def needs_libtpu():
    reason = unavailable_reason()
    if reason:
        pytest.skip(f"deviceless XLA:TPU compiles cannot run here: {reason}")
