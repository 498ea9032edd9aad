"""Suite-wide settings.

`JAXMEM_TEST_DEADLINE` (seconds since the epoch): cases that start after it are skipped, saying
so. CI sets it for its pass over the slow cases, so they run only while its time allows (the
project keeps a whole CI run well under 20 minutes on 2 cores); unset, everything runs."""

from __future__ import annotations

import os
import time

import pytest


def pytest_runtest_setup(item: pytest.Item) -> None:
    deadline = os.environ.get("JAXMEM_TEST_DEADLINE")
    if deadline and time.time() > float(deadline):
        pytest.skip("CI's time for slow cases is spent (JAXMEM_TEST_DEADLINE)")
