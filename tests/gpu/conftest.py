"""Shared fixtures for the GPU preflight tests: one cache folder for the session, and the
deviceless compiles the tests share."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def gpu_cache_dir(tmp_path_factory):
    """Every XLA:GPU compile of this session caches into a fresh folder."""
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("jaxmem-xla-gpu-cache")
    mp.setenv("JAXMEM_CACHE_DIR", str(path))
    yield str(path)
    mp.undo()
