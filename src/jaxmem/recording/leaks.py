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
    each. Only profiles taken after a call completed (or at `Recorder.step()`) are; those at a
    peak, periodic ones, the first, the last (a program's exit frees its loop's arrays) and those
    at an out-of-memory (mid-step) are taken at no step of the loop."""
    by_step: dict[int, dict[str, Any]] = {}
    for p in profiles:
        n = int((p.get("calls") or {}).get(step, 0))
        if n >= 1 and p.get("why") in ("call", "step"):
            by_step[n] = p
    return sorted(by_step.items())


def growing(series: list[tuple[int, int]]) -> float | None:
    """Arrays per step when the count of one line's arrays of one size rises at every point of
    `series` ((step, count) rows), rounded to whole arrays (a profile may be taken just before or
    just after a step's array is made); None when it does not rise at every point.

    >>> growing([(2, 2), (4, 4), (9, 8)])
    1.0
    >>> growing([(2, 2), (4, 4), (8, 4)]) is None
    True
    """
    if len(series) < MIN_POINTS:
        return None
    if any(c1 <= c0 for (_, c0), (_, c1) in zip(series, series[1:])):
        return None
    (s0, c0), (s1, c1) = series[0], series[-1]
    per_step = (c1 - c0) / (s1 - s0)
    whole = round(per_step)
    return float(whole) if whole >= 1 and abs(per_step - whole) <= 0.25 * whole else round(per_step, 3)


def array_leaks(profiles: list[dict[str, Any]], step: str) -> list[dict[str, Any]]:
    """Lines whose arrays of one size grow in number at every step count from the second
    profile on, with the bytes they keep per step."""
    pts = points(profiles, step)
    if len(pts) > MIN_POINTS:
        pts = pts[1:]  # the first step's arrays are made once (state, caches)
    if len(pts) < MIN_POINTS:
        return []
    tables = [(n, {(line, size): count for line, size, count in p.get("by_line_size", [])}) for n, p in pts]
    by_line: dict[str, dict[str, Any]] = {}
    for key in set().union(*(t for _, t in tables)):
        per_step = growing([(n, t.get(key, 0)) for n, t in tables])
        if per_step is None:
            continue
        line, size = key
        row = by_line.setdefault(line, {"line": line, "bytes_per_step": 0, "arrays_per_step": 0.0, "bytes_at_end": 0,
                                        "steps": [n for n, _ in tables], "sizes": [], "step_program": step})
        row["bytes_per_step"] += round(per_step * size)
        row["arrays_per_step"] += per_step
        row["bytes_at_end"] += size * tables[-1][1].get(key, 0)
        row["sizes"].append(size)
    return sorted(by_line.values(), key=lambda r: -r["bytes_per_step"])


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
            "donations_not_used": [{"program": d.get("program"), "text": d.get("text", "")[:500]} for d in donations]
            + unaliased(programs)}


def unaliased(programs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Donated arguments of compiled programs that no output took: the caller's array is deleted,
    and XLA may use its buffer as scratch, but no output reuses it."""
    out, seen = [], set()
    for p in programs:
        for d in p.get("donated_unaliased") or []:
            key = (p.get("name"), d["parameter"])
            if key not in seen:
                seen.add(key)
                out.append({"program": p.get("name"), "parameter": d["parameter"],
                            "text": f"argument {d['parameter']} ({d['shape']}) is donated, but no output of "
                                    f"{p.get('name')} takes its buffer (no output has its shape and type)"})
    return out
