"""Test helpers for the planner: run a plan in a real host arena, and an independent liveness.

`run_in_arena` executes a plan's schedule step by step with JAX, storing every buffered value at
its planned offset in one numpy byte arena, and recomputing fused values from the arena right
before each consumer. Before a buffer's first definition its bytes are filled with a pattern
unique to the buffer, so a planner (or checker) bug that lets two live values share bytes shows
up as a wrong result, not only as a checker message.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxmem.compiler.plan_types import Const, Plan


def _np_dtype(dtype: str) -> np.dtype:
    return np.dtype(jax.numpy.dtype(dtype))


def run_in_arena(plan: Plan, args: list[Any]) -> list[np.ndarray]:
    """Execute `plan` on flat `args` through a host arena; return the flat outputs."""
    arena = np.zeros(max(plan.arena_bytes, 1), np.uint8)
    for buf in plan.buffers:  # a distinct pattern per buffer, so stale reads give garbage
        arena[buf.offset: buf.offset + buf.size] = (buf.id * 37 + 11) % 251
    outside: dict[int, Any] = {}

    def store(v: int, value: Any) -> None:
        info = plan.values[v]
        if info.buffer is None:
            outside[v] = value
            return
        data = np.ascontiguousarray(np.asarray(value, dtype=_np_dtype(info.dtype))).view(np.uint8).reshape(-1)
        assert data.size == info.nbytes
        off = plan.buffers[info.buffer].offset
        arena[off: off + info.nbytes] = data

    def load(v: int) -> Any:
        info = plan.values[v]
        if info.buffer is None:
            if v in outside and info.producer is None:
                return outside[v]
            return compute(plan.schedule[info.producer], v)
        off = plan.buffers[info.buffer].offset
        raw = arena[off: off + info.nbytes].copy()
        return raw.view(_np_dtype(info.dtype)).reshape(info.shape)

    def operand(x: Any) -> Any:
        return x.value if isinstance(x, Const) else load(x)

    def compute(step, want: int | None = None) -> Any:
        vals = [operand(x) for x in step.operands]
        out = step.eqn.primitive.bind(*vals, **step.eqn.params)
        outs = out if step.eqn.primitive.multiple_results else [out]
        if want is not None:
            return outs[step.outputs.index(want)]
        return outs

    for k, v in enumerate(plan.invars):
        store(v, args[k])
    for step in plan.schedule:
        if step.fused:
            continue  # recomputed inside its consumers
        outs = compute(step)
        for v, value in zip(step.outputs, outs):
            if v is not None and plan.values[v].buffer is not None:
                store(v, value)
    results = []
    for k, v in enumerate(plan.outvars):
        if v is None:
            results.append(None)
        else:
            results.append(np.asarray(load(v)))
    return results


def independent_peak(plan_or_graph_steps: list[tuple[list[int], list[int]]], sizes: dict[int, int],
                     order: list[int], outputs: set[int], external: set[int]) -> int:
    """Peak live bytes of a schedule with no sharing at all: every value has its own 256-rounded
    buffer from its defining step to its last reader (outputs to the end). Steps are given as
    (inputs, outputs) pairs; `order` is a permutation of step positions."""
    n = len(order)
    defined: dict[int, int] = {}
    last: dict[int, int] = {}
    for pos, k in enumerate(order):
        ins, outs = plan_or_graph_steps[k]
        for v in ins:
            last[v] = pos
        for v in outs:
            defined[v] = pos
            last.setdefault(v, pos)
            last[v] = max(last[v], pos)
    live = [0] * (n + 2)
    for v, size in sizes.items():
        if v in external:
            continue
        start = defined.get(v, -1)
        end = n if v in outputs else last.get(v, start)
        for t in range(start + 1, end + 2):
            live[t] += (size + 255) // 256 * 256
    return max(live) if live else 0
