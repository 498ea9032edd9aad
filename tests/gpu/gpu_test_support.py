"""What the GPU tests share: the marker that skips where deviceless XLA:GPU cannot run, and the
small fusion-rule programs (`fusion_programs.py`), loaded by file as `xla_gpu_reference` loads
them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

from jaxmem.xla.gpu.compile import unavailable_reason

HERE = Path(__file__).resolve().parent
FUSION = str(HERE / "fusion_programs.py")
needs_gpu_compiler = pytest.mark.skipif(unavailable_reason() is not None,
                                        reason=f"deviceless XLA:GPU unavailable: {unavailable_reason()}")


def load_fusion_program(name: str) -> tuple[ModuleType, Callable[[], Any]]:
    """`fusion_programs` loaded afresh, and its factory `name`."""
    spec = importlib.util.spec_from_file_location("fusion_programs", FUSION)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, getattr(module, name)


def predicted_and_xla(name: str, device: str, donate: tuple[int, ...] = ()) -> tuple[Any, Any, ModuleType]:
    """(the GPU model's prediction, XLA:GPU's deviceless figures, the module) for the fusion
    program `name` on `device`, with `donate` donated."""
    from jaxmem.compiler import jaxpr_adapter as ja
    from jaxmem.xla.gpu.model import predict as gpu_model
    from jaxmem.xla.gpu.compile import xla_gpu_reference

    module, factory = load_fusion_program(name)
    ref = xla_gpu_reference(f"{FUSION}:{name}", device=device, donate_argnums=donate, top=0)
    fn, args = factory()
    traced = ja.trace(fn, args, {}, donate)
    donated = [k in traced.donated for k in range(len(traced.in_avals))]
    return gpu_model.predict(traced.closed_jaxpr, donated=donated, device=device), ref, module


def heap_cases(name: str, look: Callable[[Any], Any], device: str = "h100-80gb") -> dict[str, Any]:
    """Per scheduler the GPU model tries, `look(case)` for each `HeapCase` it builds while
    predicting the fusion program `name` on `device` (its kept predictions cleared first, so
    the heap is built here)."""
    import jax

    from jaxmem.xla.gpu.model import predict as gm
    from jaxmem.xla.gpu.model import heap as gh

    _, factory = load_fusion_program(name)
    fn, args = factory()
    seen: dict[str, Any] = {}
    original = gh.case_heap

    def spy(case: Any) -> Any:
        seen[case.scheduler] = look(case)
        return original(case)
    gh.case_heap = spy
    try:
        gm._device_temps_kept.clear()
        gm.predict(jax.make_jaxpr(fn)(*args), device=device)
    finally:
        gh.case_heap = original
        gm._device_temps_kept.clear()
    return seen


def program_fusion(name: str, device: str) -> tuple[Any, list[bool]]:
    """(the inlined program, the GPU model's fused flags on `device`) of the fusion program `name`."""
    import jax

    from jaxmem.compiler import planner
    from jaxmem.compiler.fusion import forced_fusion
    from jaxmem.xla.gpu.model.fusion import gpu_fusion

    _, factory = load_fusion_program(name)
    fn, args = factory()
    g = planner.inlined(jax.make_jaxpr(fn)(*args))
    roles = planner.value_roles(g, [False] * len(g.invars), (), ())
    return g, gpu_fusion(g, roles, forced_fusion(g, roles), store_shared_casts=True, device=device)
