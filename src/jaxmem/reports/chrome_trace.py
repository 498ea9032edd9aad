"""Memory counters over time in the Chrome trace event format (Perfetto, chrome://tracing).

A plan becomes one counter, "live memory", whose arguments are the categories: each argument
of a "ph": "C" event is one series, and chrome://tracing stacks them as the HTML chart does
(Perfetto shows one track per series). Each step is also a 1 µs "X" slice named after its
primitive, so the counters line up with the operations. A replay becomes one counter per
allocator with "in_use" and "reserved" series, plus an instant event at an out-of-memory.

    events = trace_events(from_plan(plan))
    write_chrome_trace("trace.json", from_plan(plan))

Timestamps are microseconds. A plan has no clock, so step x sits at x + 1 µs; a replay uses
the trace's own times when they increase, else the event index.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from jaxmem.reports.data import ReportData
from jaxmem.reports.html import MAX_POINTS, downsample

PID = 1


def _meta(name: str, tid: int, thread: str) -> list[dict[str, Any]]:
    return [
        {"name": "process_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": name}},
        {"name": "thread_name", "ph": "M", "pid": PID, "tid": tid, "args": {"name": thread}},
    ]


def _plan_events(data: ReportData) -> list[dict[str, Any]]:
    events = _meta(f"jaxmem: {data.title}", 1, "schedule")
    cols = [data.stacked[c] for c in data.categories]
    for i, name in enumerate(data.x_names):
        ts = i  # x = i + x_min, shifted so the entry state sits at 0
        args = {c: col[i] for c, col in zip(data.categories, cols)}
        events.append({"name": "live memory", "ph": "C", "ts": ts, "pid": PID, "tid": 1, "args": args})
        events.append({"name": name, "ph": "X", "ts": ts, "dur": 1, "pid": PID, "tid": 1,
                       "args": {"step": i + data.x_min, "live_bytes": sum(args.values())}})
    events.append({"name": "peak", "ph": "i", "s": "g", "ts": data.peak_x - data.x_min, "pid": PID, "tid": 1,
                   "args": {"step": data.peak_x, "bytes": data.peak_bytes}})
    return events


def _replay_events(data: ReportData) -> list[dict[str, Any]]:
    events = _meta(f"jaxmem replay: {data.title}", 1, "events")
    for series in data.allocators:
        times = series.times_us
        clock = times if len(times) == len(series.xs) and all(b > a for a, b in zip(times, times[1:])) else None
        for i, x in enumerate(series.xs):
            ts = clock[i] if clock else x
            events.append({"name": f"{series.name} memory", "ph": "C", "ts": ts, "pid": PID, "tid": 1,
                           "args": {"in_use": series.in_use[i], "reserved": series.reserved[i]}})
        if series.oom_x is not None:
            ts = series.oom_x
            if clock:
                ts = clock[min(range(len(series.xs)), key=lambda j: abs(series.xs[j] - series.oom_x))]
            events.append({"name": f"{series.name}: out of memory", "ph": "i", "s": "g", "ts": ts, "pid": PID,
                           "tid": 1, "args": {"event": series.oom_x, "detail": series.oom_text}})
    if data.categories:
        # The recorded blocks, by event index: per bucket of events the busiest one, as many
        # points as the replayed lines keep (a million counter events would not load).
        pts = downsample(data, MAX_POINTS)
        for x, *values in zip(pts["x"], *pts["cols"]):
            args = dict(zip(data.categories, values))
            events.append({"name": "recorded live memory", "ph": "C", "ts": x, "pid": PID + 1, "tid": 1, "args": args})
        events += [{"name": "process_name", "ph": "M", "pid": PID + 1, "tid": 1,
                    "args": {"name": "recorded trace (by event index)"}}]
    return events


def trace_events(data: ReportData) -> list[dict[str, Any]]:
    """The trace events for a report: counters, steps and markers.

    >>> from jaxmem.reports.doc_example import sgd_step_plan
    >>> plan = sgd_step_plan()   # one SGD step: w (64, 64) is updated and returned, x (8, 64) only read
    >>> from jaxmem.reports.data import from_plan
    >>> data = from_plan(plan)
    >>> [e for e in trace_events(data) if e["ph"] == "C"][0]["args"]   # on entry: the arguments
    {'parameters': 16384, 'inputs': 2048, 'residuals': 0, ...}
    """
    return _plan_events(data) if data.kind == "plan" else _replay_events(data)


def write_chrome_trace(path: str | Path, data: ReportData) -> int:
    """Write {"traceEvents": [...], "displayTimeUnit": "ns"} to `path`, gzipped when it ends in
    .gz (Perfetto and chrome://tracing open both); returns the event count."""
    events = trace_events(data)
    doc = {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"producer": "jaxmem", "x": data.x_label}}
    text = json.dumps(doc, separators=(",", ":"))
    if str(path).lower().endswith(".gz"):
        Path(path).write_bytes(gzip.compress(text.encode("utf-8"), mtime=0))
    else:
        Path(path).write_text(text, encoding="utf-8")
    return len(events)
