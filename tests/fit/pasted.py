"""Fit's printed answer pasted into a file's text, as a user pastes it: each
"file:line (function): statement" line's statement in place of the line it names (indented as
that line is), and the helper printed after "pasted once beside the step:" added at the end.
Shared by the tests and by benchmarks/bench_fit_mesh.py, which compile the result with JAX's own
AOT path."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

MARK = "pasted once beside the step:"


def paste(code: str, source: str) -> str:
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if line.endswith(MARK))
    text = source.splitlines()
    edits = [re.match(r"(.+):(\d+) \(\w+\): (.*)$", line) for line in lines[:start]]
    if not edits or not all(edits):
        raise ValueError(f"not fit's printed lines: {lines[:start]}")
    for m in edits:
        old = text[int(m.group(2)) - 1]
        text[int(m.group(2)) - 1] = old[: len(old) - len(old.lstrip())] + m.group(3)
    return "\n".join(text + [""] + lines[start + 1:]) + "\n"


def load(path: str, name: str = "pasted_module") -> Any:
    """The module at `path`, imported under `name`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
