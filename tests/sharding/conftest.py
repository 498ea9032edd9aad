"""Every compile of the sharding tests caches into a fresh folder of this session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def sharded_cache_dir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    path = tmp_path_factory.mktemp("jaxmem-sharded-cache")
    mp.setenv("JAXMEM_CACHE_DIR", str(path))
    yield str(path)
    mp.undo()
