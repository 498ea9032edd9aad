"""The summary of a recording (`recording.json`): what the run held, where it peaked, what leaked.

Built from the recorder's files, so that a run that was killed before it could write its own
summary gets one too (`summarize_files`).
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path
from typing import Any

from jaxmem.recording.leaks import find_leaks
from jaxmem.recording.store import read_jsonl

HOW_CALLS = ("memory_stats() when each call of a jitted function completes (the recorder's thread waits "
             "for one of its outputs; dispatch is not blocked), and every {interval} s between")
HOW_NO_STATS = "{devices}: no memory_stats() on this backend; the live arrays' bytes and profiles are recorded instead"


def device_peaks(samples: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per device: the highest peak in use, peak reserved, and their sum, as memory_stats() gave
    them (or the most live-array bytes where it gave none)."""
    out: dict[str, dict[str, int]] = {}
    for s in samples:
        peak = out.setdefault(s["device"], {})
        for key in ("peak_bytes_in_use", "peak_bytes_reserved", "live_array_bytes", "bytes_limit"):
            if key in s:
                peak[key] = max(peak.get(key, 0), int(s[key]))
        if "peak_bytes_in_use" in s:
            both = int(s["peak_bytes_in_use"]) + int(s.get("peak_bytes_reserved", 0))
            peak["peak_in_use_plus_reserved"] = max(peak.get("peak_in_use_plus_reserved", 0), both)
    return out


def per_call(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per completed call: program, call number, and the device's running peak then."""
    rows = []
    for s in samples:
        if s.get("why") != "call":
            continue
        row = {k: s.get(k) for k in ("t", "program", "call", "device", "confirmed", "bytes_in_use",
                                      "peak_bytes_in_use", "bytes_reserved", "peak_bytes_reserved",
                                      "live_array_bytes")}
        if s.get("peak_bytes_in_use") is not None:
            row["peak"] = int(s["peak_bytes_in_use"]) + int(s.get("peak_bytes_reserved", 0))
        rows.append(row)
    return rows


def summarize_files(out: str | Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """A recording's summary from its files alone."""
    out = Path(out)
    samples = read_jsonl(out / "samples.jsonl")
    profiles = read_jsonl(out / "profiles.jsonl")
    programs = read_jsonl(out / "programs.jsonl")
    events = read_jsonl(out / "events.jsonl")
    calls: dict[str, int] = {}
    for s in samples:
        if s.get("why") == "call" and s.get("program"):
            calls[s["program"]] = max(calls.get(s["program"], 0), int(s.get("call") or 0))
    donations = [e for e in events if e.get("event") == "donation_not_used"]
    return {"format": "jaxmem-recording/1", **(meta or {}),
            "devices": device_peaks(samples), "calls": calls, "per_call": per_call(samples),
            "programs": programs, "profiles": [{k: p.get(k) for k in ("t", "why", "file", "program", "call",
                                                                         "buffer_bytes", "buffers", "executables")}
                                               for p in profiles],
            "leaks": find_leaks(profiles, programs, donations, calls),
            "postmortems": sorted(p.name for p in out.glob("postmortem-*.json"))}


def summarize(recorder: Any) -> dict[str, Any]:
    """The summary of a recorder that has just stopped."""
    import jax

    options = recorder.options
    how = [HOW_CALLS.format(interval=options.interval) if options.count_calls
           else f"memory_stats() every {options.interval} s"]
    if recorder.no_stats:
        how.append(HOW_NO_STATS.format(devices=", ".join(sorted(recorder.no_stats))))
    meta = {"argv": recorder.argv, "python": sys.version.split()[0], "platform": platform.platform(),
            "jax": jax.__version__, "how": how, "untimed_calls": recorder.untimed_calls,
            "user_steps": recorder.user_steps, "dropped_lines": recorder.store.dropped_lines,
            "device_kinds": sorted({str(getattr(d, "device_kind", d.platform)) for d in recorder.devices()})}
    summary = summarize_files(recorder.store.out, meta)
    for name, count in recorder.counter.calls.items():  # calls read without a sample line too
        summary["calls"][name] = max(summary["calls"].get(name, 0), count)
    return summary
