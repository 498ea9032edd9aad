"""docs/python.md runs: every `>>>` example in it prints what the page shows, against XLA:TPU and
XLA:GPU compiled deviceless (the page's figures are theirs, not copied by hand)."""

from __future__ import annotations

import doctest
import os

import pytest

from jaxmem.xla.gpu.compile import unavailable_reason as gpu_reason
from jaxmem.xla.tpu.compile import unavailable_reason as tpu_reason

PAGE = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "python.md")


@pytest.mark.skipif(bool(tpu_reason() or gpu_reason()), reason="the page compiles for a v5e and an H100")
def test_the_python_page_runs_as_it_reads():
    failures, tried = doctest.testfile(PAGE, module_relative=False, report=True,
                                       optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert tried > 20
    assert failures == 0
