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


def jaxmem_program(name: str) -> Any:
    """jaxmem's `Program` of the step, from what a user hands `jaxmem.analyze`."""
    from jaxmem.api.program import prepare

    fn, args, kwargs = user_call(load(name))
    return prepare(fn, args, kwargs)


def tpu_figures_and_pool(name: str, factory_on_chip: bool, device: str = "tpu-v5e-16gb") -> tuple[Any, Any]:
    """jaxmem's deviceless XLA:TPU figures of the step and the TPU runtime's verdict over 3
    steps, as `jaxmem analyze TARGET` makes them: where the step's objects were made on the chip
    (`factory_on_chip`), the programs its factory ran are recorded (a TPU keeps their code)."""
    from jaxmem.api.pipeline import Options, Planless, Run, collect_references, simulate_pool, start_references
    from jaxmem.api.program import prepare
    from jaxmem.compiler.jaxpr_adapter import run_recording_programs

    import jax

    module = load(name)
    if factory_on_chip:   # as in a fresh process: every program the factory runs is compiled, so recorded
        jax.clear_caches()
        (fn, args, kwargs), texts = run_recording_programs(lambda: user_call(module))
    else:
        (fn, args, kwargs), texts = user_call(module), []
    run = Run(Options(device=device), prepare(fn, args, kwargs), name, factory_texts=texts, say=lambda text: None)
    start_references(run)
    run.worker.join()
    run.plan = Planless()
    collect_references(run)
    simulate_pool(run)
    return run.tpu, run.pool
