"""Every `>>>` example in the package's docstrings runs and prints what it shows.

One test per module, found with `pkgutil.walk_packages`, so a new module is covered without
touching this file. `jaxmem.examples` is left out: tests/analyze/test_analyze_examples.py runs
those (slow: the example models run op by op).
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"   # the examples show host (CPU) figures; set before JAX loads

import contextlib
import doctest
import importlib
import importlib.util
import io
import pkgutil

import pytest

ROOTS = ["jaxmem.compiler", "jaxmem.runtime", "jaxmem.traces", "jaxmem.reports", "jaxmem.share",
         "jaxmem.units", "jaxmem.errors", "jaxmem.trace_schema", "jaxmem.execution", "jaxmem.xla",
         "jaxmem.cli", "jaxmem.fitting.fit", "jaxmem.recording"]
EXCLUDED = ("jaxmem.examples",)
SLOW: set[str] = set()   # modules whose examples take seconds; none at present
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules() -> list[str]:
    names = []
    for root in ROOTS:
        names.append(root)
        spec = importlib.util.find_spec(root)
        if spec.submodule_search_locations:   # a package: every module under it
            names += [info.name for info in pkgutil.walk_packages(spec.submodule_search_locations, root + ".")]
    return sorted(n for n in set(names) if not n.startswith(EXCLUDED) and not n.endswith(".__main__"))


MODULES = _modules()


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in MODULES])
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    report = io.StringIO()
    with contextlib.redirect_stdout(report):
        failures, _ = doctest.testmod(module, optionflags=FLAGS, report=False)
    if failures:
        pytest.fail(f"{failures} failing example(s) in {name}:\n{report.getvalue()}", pytrace=False)


def test_every_root_is_found():
    assert set(ROOTS) <= set(MODULES)
    assert len(MODULES) > len(ROOTS)
