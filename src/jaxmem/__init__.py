"""jaxmem: see, predict and cut the device memory of JAX programs.

Runtime: `Device` (a simulated or host pool carved by a BFC, growth or platform allocator).
Compiler: `plan(fn, *args)` plans a traced function's memory. Execution: `jit`, `eager`.
Rematerialization: `fit`. Sharing one GPU: `reserve`. On a GPU or TPU, from a notebook:
`analyze(fn, *args, device=...)` (per device for sharded arguments) and
`maxbatch(make, arg=..., device=...)`. A run's memory as it happens: `record`; an out-of-memory
text explained: `explain`.

Names are imported lazily so that `import jaxmem` stays cheap and does not import JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

from jaxmem.errors import (
    AllocationError,
    ConfigError,
    JaxmemError,
    LedgerError,
    OutOfMemory,
    PlanError,
    TraceError,
)
from jaxmem.units import parse_size, format_size

__version__ = "0.1.0"

_LAZY = {
    "Device": "jaxmem.runtime.device",
    "Buffer": "jaxmem.runtime.allocator",
    "plan": "jaxmem.api.plan",
    "Plan": "jaxmem.compiler.plan_types",
    "jit": "jaxmem.execution.jit",
    "clear_caches": "jaxmem.execution.jit",
    "eager": "jaxmem.execution.eager",
    "fit": "jaxmem.fitting.fit",
    "FitResult": "jaxmem.fitting.fit",
    "reserve": "jaxmem.share.ledger",
    "load_trace": "jaxmem.traces.readers",
    "analyze": "jaxmem.api.analyze",
    "Analysis": "jaxmem.api.result",
    "ShardedAnalysis": "jaxmem.api.sharded",
    "maxbatch": "jaxmem.api.maxbatch",
    "MaxbatchResult": "jaxmem.api.maxbatch",
    "replay": "jaxmem.traces.replay",
    "record": "jaxmem.recording.recorder",
    "Recorder": "jaxmem.recording.recorder",
    "explain": "jaxmem.recording.explain",
}

__all__ = [
    "AllocationError", "ConfigError", "JaxmemError", "LedgerError", "OutOfMemory", "PlanError",
    "TraceError", "parse_size", "format_size", *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jaxmem' has no attribute {name!r}")
