"""The framework steps of the evaluation and tuning sets, loaded by name, and the two readings
every check compares: the program as the framework itself compiles it (`module.lowered()`) and
the program jaxmem reads from what a user hands it (`module.make()`, and `module.keywords()`
where the step takes keyword arguments).

    from steps import load, names
    module = load("eval/nnx_cnn_plain")
"""
from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
SETS = ("eval", "tuning")


def names(which: str = "eval") -> list[str]:
    """`eval/<module>` names of one set (or `both`), sorted."""
    sets = SETS if which == "both" else (which,)
    return [f"{s}/{f[:-3]}" for s in sets for f in sorted(os.listdir(os.path.join(HERE, s)))
            if f.endswith(".py") and not f.startswith("_")]


def load(name: str) -> Any:
    """The module of `eval/<module>` or `tuning/<module>`, imported once."""
    key = "framework_step_" + name.replace("/", "_")
    if key in sys.modules:
        return sys.modules[key]
    if HERE not in sys.path:
        sys.path.insert(0, HERE)   # keras_truth
    spec = importlib.util.spec_from_file_location(key, os.path.join(HERE, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def user_call(module: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """(fn, args, kwargs) as a user hands them to `jaxmem.analyze`."""
    fn, args = module.make()
    return fn, tuple(args), (module.keywords() if hasattr(module, "keywords") else {})


def figures(memory_analysis: Any) -> dict[str, int]:
    """A `CompiledMemoryStats` as the four figures jaxmem compares."""
    return {"argument_bytes": int(memory_analysis.argument_size_in_bytes),
            "output_bytes": int(memory_analysis.output_size_in_bytes),
            "alias_bytes": int(memory_analysis.alias_size_in_bytes),
            "temp_bytes": int(memory_analysis.temp_size_in_bytes)}
