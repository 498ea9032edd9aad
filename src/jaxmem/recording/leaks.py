"""Leaks in a recorded run: memory that grows step after step, programs compiled again and
again, and donations JAX could not use.

The step is the jitted function called most often. Profiles are taken after its calls 1, 2, 4, 8,
... (`recorder.py`), so each line of the user's code has its bytes at several step counts: a line
whose bytes rise at every one of them, past the first, keeps memory each step, and its slope is
the bytes it keeps per step.

    leaks = find_leaks(profiles, programs, donations, calls)
    leaks["arrays"][0]   # {"line": "train.py:42 (main)", "bytes_per_step": 4194304, ...}
"""

from __future__ import annotations

from typing import Any

MIN_POINTS = 3


def step_program(calls: dict[str, int]) -> str | None:
    """The jitted function called most often (ties: the first in the dict).

    >>> step_program({"init": 1, "train_step": 20, "eval_step": 2})
    'train_step'
    """
    return max(calls, key=lambda k: calls[k]) if calls else None


def points(profiles: list[dict[str, Any]], step: str) -> list[tuple[int, dict[str, Any]]]:
    """(step count, profile) for each step count a profile was taken at, the latest profile for
    each, skipping those of an out-of-memory (taken mid-step)."""
    by_step: dict[int, dict[str, Any]] = {}
    for p in profiles:
        n = int((p.get("calls") or {}).get(step, 0))
        if n >= 1 and p.get("why") != "oom":
            by_step[n] = p
    return sorted(by_step.items())


def growing(series: list[tuple[int, int, int]]) -> tuple[float, float] | None:
    """(bytes per step, arrays per step) when the bytes rise at every point of `series`
    ((step, bytes, count) rows); None otherwise.

    >>> growing([(2, 8, 2), (4, 16, 4), (8, 32, 8)])
    (4.0, 1.0)
    >>> growing([(2, 8, 2), (4, 16, 4), (8, 16, 4)]) is None
    True
    """
    if len(series) < MIN_POINTS:
        return None
    if any(b1 <= b0 for (_, b0, _), (_, b1, _) in zip(series, series[1:])):
        return None
    (s0, b0, c0), (s1, b1, c1) = series[0], series[-1]
    arrays = (c1 - c0) / (s1 - s0)
    whole = round(arrays)
    if c1 > c0 and whole >= 1 and abs(arrays - whole) <= 0.15 * whole:
        # Whole arrays per step: a profile may be taken just before or after a step's array is
        # made, so the count of arrays per step is rounded, and each array's size is exact.
        return whole * (b1 - b0) / (c1 - c0), float(whole)
    return (b1 - b0) / (s1 - s0), arrays


def array_leaks(profiles: list[dict[str, Any]], step: str) -> list[dict[str, Any]]:
    """Lines whose live bytes grow at every step count from the second profile on."""
    pts = points(profiles, step)
    if len(pts) > MIN_POINTS:
        pts = pts[1:]  # the first step's arrays are made once (state, caches)
    if len(pts) < MIN_POINTS:
        return []
    out = []
    lines = set().union(*(p["by_line"] for _, p in pts))
    for line in lines:
        series = [(n, *(p["by_line"].get(line) or (0, 0))) for n, p in pts]
        slope = growing(series)
        if slope:
            out.append({"line": line, "bytes_per_step": round(slope[0]), "arrays_per_step": round(slope[1], 3),
                        "bytes_at_end": series[-1][1], "steps": [n for n, _ in pts], "bytes": [b for _, b, _ in series],
                        "step_program": step})
    return sorted(out, key=lambda r: -r["bytes_per_step"])


def recompiles(programs: list[dict[str, Any]], step: str | None) -> list[dict[str, Any]]:
    """Programs compiled again and again under one name after the loop's second step (a shape
    or a static argument that changes every step compiles every step)."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for p in programs:
        by_name.setdefault(str(p.get("name")), []).append(p)
    out = []
    for name, seen in by_name.items():
        late = [p for p in seen if step and int((p.get("calls") or {}).get(step, 0)) >= 2]
        if len(late) >= 2:
            out.append({"program": name, "compiles": len(seen), "during_loop": len(late),
                        "code_bytes": sum(int(p.get("generated_code_size_in_bytes", 0)) for p in seen)})
    return sorted(out, key=lambda r: -r["compiles"])


def find_leaks(profiles: list[dict[str, Any]], programs: list[dict[str, Any]], donations: list[dict[str, Any]],
               calls: dict[str, int]) -> dict[str, Any]:
    """Everything that looks like a leak in a recording, each with its line or program."""
    step = step_program(calls)
    return {"step_program": step, "step_calls": calls.get(step, 0) if step else 0,
            "arrays": array_leaks(profiles, step) if step else [],
            "recompiles": recompiles(programs, step),
            "donations_not_used": [{"program": d.get("program"), "text": d.get("text", "")[:500]} for d in donations]}
