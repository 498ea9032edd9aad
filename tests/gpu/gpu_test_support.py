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
