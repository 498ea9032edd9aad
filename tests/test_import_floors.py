"""The package floors of docs/architecture.md hold for every import in src/jaxmem.

Every module is read with `ast` (nothing is imported, so an import inside a function counts as
much as one at the top): each `import jaxmem...` / `from jaxmem... import ...` / relative
import is resolved to the module it loads. Then (a) no module reaches itself again along those
imports, and (b) no module imports a package on its own floor or above, the floors being read
from the table in docs/architecture.md's "Floors" section, so the document and this test
cannot drift apart.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOC = ROOT / "docs" / "architecture.md"


def module_files(src: Path) -> dict[str, Path]:
    """Dotted name -> file, for every module under src/jaxmem (a package by its `__init__`)."""
    found = {}
    for path in sorted((src / "jaxmem").rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = module_files(SRC)


def _loaded(name: str, modules: dict[str, Path]) -> str | None:
    """The jaxmem module `import name` loads: `name` itself, or for `pkg.module.attr` the longest
    prefix that is a module. None outside jaxmem."""
    if name != "jaxmem" and not name.startswith("jaxmem."):
        return None
    while name not in modules:
        name = name.rpartition(".")[0]
    return name


def imports_of(name: str, modules: dict[str, Path]) -> set[str]:
    """Every jaxmem module `name` imports, anywhere in its file (top level, functions, classes)."""
    tree = ast.parse(modules[name].read_text(), filename=str(modules[name]))
    package = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(filter(None, (_loaded(alias.name, modules) for alias in node.names)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `from ..x import y` in package a.b is a.x
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                # `from pkg import module` loads that module; `from module import name`, the module
                target = _loaded(source if alias.name == "*" else f"{source}.{alias.name}", modules)
                if target is not None:
                    found.add(target)
    found.discard(name)
    return found


GRAPH = {name: imports_of(name, MODULES) for name in MODULES}


def unit_of(module: str) -> str:
    """The package (or top-level module) a module belongs to: what a floor holds."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "jaxmem"


def floors_from_doc(text: str) -> dict[str, int]:
    """The "Floors" section's table: package -> floor (1 lowest)."""
    section = re.search(r"^## Floors\b.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "docs/architecture.md has no '## Floors' section"
    floors = {}
    for number, packages in re.findall(r"^\|\s*(\d+)\s*\|([^|]*)\|", section.group(1), re.M):
        for package in re.findall(r"`([\w.]+)`", packages):
            assert package not in floors, f"{package} is on two floors in docs/architecture.md"
            floors[package] = int(number)
    return floors


FLOORS = floors_from_doc(DOC.read_text())


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a -> ... -> a) for each group of modules that import each other round a circle
    (Tarjan's strongly connected components, each shown by a shortest circle through its first
    module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle(graph, group) for group in groups]


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first, inside the group, back to start
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start}")


def test_the_import_reader_sees_imports_inside_functions_and_relative_ones(tmp_path):
    # An independent truth: a made-up package whose every import form is known.
    package = tmp_path / "jaxmem" / "pkg"
    package.mkdir(parents=True)
    (tmp_path / "jaxmem" / "__init__.py").write_text("")
    (tmp_path / "jaxmem" / "low.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "b.py").write_text("X = 1\n")
    (package / "a.py").write_text(
        "from . import b\n"
        "def f():\n"
        "    from ..low import thing\n"
        "    import jaxmem.pkg.b as bee\n"
        "    from jaxmem.pkg.b import X\n")
    found = module_files(tmp_path)
    assert set(found) == {"jaxmem", "jaxmem.low", "jaxmem.pkg", "jaxmem.pkg.a", "jaxmem.pkg.b"}
    assert imports_of("jaxmem.pkg.a", found) == {"jaxmem.pkg.b", "jaxmem.low"}
    assert imports_of("jaxmem.pkg", found) == set()


def test_cycles_finds_a_circle_and_none_in_a_tree():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_floors_table_names_every_package_and_only_real_ones():
    units = {unit_of(m) for m in MODULES}
    assert set(FLOORS) == units, (f"not on a floor in docs/architecture.md: {sorted(units - set(FLOORS))}; "
                                  f"on a floor but not in src/jaxmem: {sorted(set(FLOORS) - units)}")


def test_no_import_circle_between_modules():
    found = cycles(GRAPH)
    assert not found, "modules that import each other round a circle:\n" + "\n".join(
        " -> ".join(c) for c in found)


@pytest.mark.parametrize("unit", sorted(FLOORS, key=lambda u: (FLOORS[u], u)))
def test_a_package_imports_only_from_lower_floors(unit):
    wrong = sorted(f"{m} -> {t} (floor {FLOORS[unit_of(t)]})"
                   for m in GRAPH if unit_of(m) == unit
                   for t in GRAPH[m] if unit_of(t) != unit and FLOORS[unit_of(t)] >= FLOORS[unit])
    assert not wrong, f"{unit} is on floor {FLOORS[unit]}; it imports from its floor or above:\n" + "\n".join(wrong)
