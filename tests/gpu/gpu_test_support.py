"""What the GPU tests share: the marker that skips where deviceless XLA:GPU cannot run, and the
small fusion-rule programs (`fusion_programs.py`), loaded by file as `xla_gpu_reference` loads
them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

from jaxmem.xla.gpu import unavailable_reason

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
    from jaxmem.xla import gpu_model
    from jaxmem.xla.gpu import xla_gpu_reference

    module, factory = load_fusion_program(name)
    ref = xla_gpu_reference(f"{FUSION}:{name}", device=device, donate_argnums=donate, top=0)
    fn, args = factory()
    traced = ja.trace(fn, args, {}, donate)
    donated = [k in traced.donated for k in range(len(traced.in_avals))]
    return gpu_model.predict(traced.closed_jaxpr, donated=donated, device=device), ref, module
