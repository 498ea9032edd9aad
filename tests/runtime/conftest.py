"""The `factory` fixture: every allocator in runtime_checks.FACTORIES, one test run each."""

from __future__ import annotations

import pytest
from runtime_checks import FACTORIES


@pytest.fixture(params=sorted(FACTORIES))
def factory(request):
    return FACTORIES[request.param]
