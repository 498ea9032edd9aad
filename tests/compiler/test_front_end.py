"""One front end: only the modules docs/architecture.md names touch JAX's internals, trace with
`make_jaxpr`, or walk a raw jaxpr's equations. Read from every source module's syntax tree
(docstrings and comments, which mention these names, are not code)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "jaxmem"

# JAX's jaxpr classes and private modules: what a JAX release renames.
INTERNAL_PREFIXES = ("jax._src", "jax.interpreters", "jax.core", "jax.extend")
INTERNAL_SUBMODULES = frozenset({"_src", "interpreters", "core", "extend"})

# The documented exceptions (docs/architecture.md, compiler/): the front end traces, walks and
# reads JAX's jaxpr classes; fitting's hooks module reaches the JAX functions fit hooks; the
# recorder's hooks module reaches JAX's backend start-up hook in the user's running program.
MAY_IMPORT_INTERNALS = {"compiler/jaxpr_adapter.py", "fitting/jax_hooks.py", "recording/jax_hooks.py"}
MAY_TRACE = {"compiler/jaxpr_adapter.py"}
MAY_WALK = {"compiler/jaxpr_adapter.py"}


def _is_internal(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in INTERNAL_PREFIXES)


def violations(source: str) -> dict[str, list[int]]:
    """Lines of `source` that import JAX internals ("internals"), call `make_jaxpr` ("trace")
    or read a jaxpr's `.eqns` ("walk")."""
    found: dict[str, list[int]] = {"internals": [], "trace": [], "walk": []}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            if any(_is_internal(a.name) for a in node.names):
                found["internals"].append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if _is_internal(node.module) or (node.module == "jax"
                                             and any(a.name in INTERNAL_SUBMODULES for a in node.names)):
                found["internals"].append(node.lineno)
        elif isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "jax" and node.attr in INTERNAL_SUBMODULES:
                found["internals"].append(node.lineno)
            if node.attr == "eqns":
                found["walk"].append(node.lineno)
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name == "make_jaxpr":
                found["trace"].append(node.lineno)
    return found


def _modules() -> dict[str, dict[str, list[int]]]:
    return {path.relative_to(SRC).as_posix(): violations(path.read_text())
            for path in sorted(SRC.rglob("*.py"))}


def test_the_scan_finds_each_kind_of_access():
    source = "\n".join([
        "import jax",
        "from jax._src import api",
        "import jax.interpreters.ad as ad",
        "from jax.extend import core",
        "from jax import core as jcore",
        "x = jax.core.ShapedArray((1,), None)",
        "closed = jax.make_jaxpr(f)(1.0)",
        "n = len(closed.jaxpr.eqns)",
        '"""jax.make_jaxpr(f) and from jax._src import api, in a docstring"""',
        "import jax.numpy as jnp",
    ])
    assert violations(source) == {"internals": [2, 3, 4, 5, 6], "trace": [7], "walk": [8]}


def test_only_the_documented_modules_touch_jax_internals():
    offenders = {m: v["internals"] for m, v in _modules().items()
                 if v["internals"] and m not in MAY_IMPORT_INTERNALS}
    assert offenders == {}


def test_only_the_front_end_traces_and_walks_raw_jaxprs():
    modules = _modules()
    tracing = {m: v["trace"] for m, v in modules.items() if v["trace"] and m not in MAY_TRACE}
    walking = {m: v["walk"] for m, v in modules.items() if v["walk"] and m not in MAY_WALK}
    assert (tracing, walking) == ({}, {})


def test_the_documented_exceptions_are_the_ones_that_need_it():
    """Each module allowed to touch internals does (a stale allowance would hide a new one),
    and docs/architecture.md names each."""
    modules = _modules()
    assert {m for m in MAY_IMPORT_INTERNALS if modules[m]["internals"]} == MAY_IMPORT_INTERNALS
    assert {m for m in MAY_TRACE if modules[m]["trace"]} == MAY_TRACE
    doc = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    for module in MAY_IMPORT_INTERNALS:
        assert Path(module).stem in doc, module
