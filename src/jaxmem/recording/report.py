"""A recording shown: a few lines for the terminal, a self-contained HTML page, JSON.

    data = load_recording("run1")      # summary + post-mortems (rebuilt if the run was killed)
    print(render_text(data))
    Path("run1.html").write_text(render_html(data))

The HTML page draws, per device, the memory in use and in use + reserved over the run (one point
per reading; the calls of the step marked), with jaxmem's pool prediction for the same step beside
it where one was made, then tables: the live arrays at the peak and at each out-of-memory by line,
leaks, programs. Every name from the user's code is escaped; nothing is fetched from the network.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from jaxmem.errors import TraceError
from jaxmem.recording.postmortem import left_over_note, text_figures
from jaxmem.recording.store import read_jsonl
from jaxmem.recording.summary import summarize_files
from jaxmem.reports.escape import plain
from jaxmem.reports.html import render_table
from jaxmem.units import format_size

MAX_POINTS = 4000


def load_recording(folder: str | Path) -> dict[str, Any]:
    """A recording's summary, post-mortems and samples; the summary is rebuilt from the files
    where the run ended before writing it.

    Raises:
        TraceError: `folder` holds no recording.
    """
    folder = Path(folder)
    if not folder.is_dir() or not ((folder / "samples.jsonl").exists() or (folder / "recording.json").exists()):
        raise TraceError(f"{folder}: not a jaxmem recording (no samples.jsonl or recording.json)")
    try:
        summary = json.loads((folder / "recording.json").read_text(encoding="utf-8"))
        rebuilt = False
    except (OSError, ValueError):
        summary, rebuilt = summarize_files(folder), True
    posts = []
    for name in summary.get("postmortems", []):
        try:
            post = json.loads((folder / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        # The text is the record; its figures are read again by this jaxmem's parser.
        post.update(text_figures(str(post.get("message", "")), post.get("largest_free_block")))
        held = post.get("held") or {}
        if held.get("bytes_in_use") is not None and held.get("array_bytes") is not None:
            held["left_over_bytes"] = held["bytes_in_use"] - held["array_bytes"]
            held["left_over"] = left_over_note(held["left_over_bytes"], post.get("executables"))
        posts.append(post)
    return {"folder": str(folder), "summary": summary, "rebuilt": rebuilt, "postmortems": posts,
            "samples": read_jsonl(folder / "samples.jsonl"), "profiles": read_jsonl(folder / "profiles.jsonl")}


def _size(n: Any) -> str:
    return "?" if n is None else format_size(int(n))


def device_lines(summary: dict[str, Any]) -> list[str]:
    """One line per device the program used. JAX starts its CPU backend beside a TPU or GPU one:
    a CPU device that never held an array is left out there."""
    out = []
    devices = summary.get("devices", {})
    accelerated = any("peak_bytes_in_use" in peak for peak in devices.values())
    for name, peak in devices.items():
        if accelerated and "peak_bytes_in_use" not in peak and not peak.get("live_array_bytes"):
            continue
        if "peak_bytes_in_use" in peak:
            limit = f" of {_size(peak['bytes_limit'])}" if peak.get("bytes_limit") else ""
            out.append(f"{name}: peak in use {_size(peak['peak_bytes_in_use'])} + reserved "
                       f"{_size(peak.get('peak_bytes_reserved', 0))}; in use + reserved at most "
                       f"{_size(peak['peak_in_use_plus_reserved'])}{limit}")
        elif "live_array_bytes" in peak:
            out.append(f"{name}: live arrays at most {_size(peak['live_array_bytes'])} (no memory_stats())")
    return out


def leak_lines(leaks: dict[str, Any]) -> list[str]:
    out = []
    step = leaks.get("step_program")
    for leak in leaks.get("arrays", []):
        out.append(f"leak: {plain(leak['line'])} keeps {_size(leak['bytes_per_step'])} per step of {plain(step)} "
                   f"({leak['arrays_per_step']:g} array{'' if leak['arrays_per_step'] == 1 else 's'} per step; "
                   f"{_size(leak['bytes_at_end'])} at the end)")
    for r in leaks.get("recompiles", []):
        out.append(f"recompiles: {plain(r['program'])} compiled {r['during_loop']} times during the loop "
                   f"({r['compiles']} in all, {_size(r['code_bytes'])} of code)")
    for d in leaks.get("donations_not_used", []):
        out.append(f"donation not used in {plain(d.get('program') or '?')}: {plain(d['text'][:160])}")
    return out


def postmortem_lines(post: dict[str, Any]) -> list[str]:
    what = {"tpu_buffer": "a buffer could not be allocated", "tpu_program_load": "a program could not be loaded",
            "tpu_compile_hbm": "the compile needs more memory than the chip has",
            "cpu_alloc": "the host could not allocate a buffer", "gpu_xla_oom": "XLA:GPU could not allocate",
            "gpu_bfc": "the BFC allocator could not allocate"}
    out = [f"out of memory ({plain(post.get('kind'))}): {what.get(post.get('kind'), 'RESOURCE_EXHAUSTED')}"
           f"{' in ' + plain(post['program']) if post.get('program') else ''}: asked {_size(post.get('requested'))}, "
           + (f"limit {_size(post.get('limit'))}" if post.get("limit") else
              f"free {_size(post.get('free'))}, largest free block {_size(post.get('largest_free_block'))}")
           + f" ({post.get('verdict')})"]
    if post.get("meaning"):
        out.append(f"  {plain(post['meaning'])}")
    held = post.get("held", {})
    if held.get("bytes_in_use") is not None:
        out.append(f"  bytes_in_use {held['bytes_in_use']:,} B = live arrays {held['array_bytes']:,} B + "
                   f"{held['left_over_bytes']:,} B: {plain(held.get('left_over', ''))}")
    for row in post.get("held", {}).get("by_line", [])[:5]:
        out.append(f"  held: {plain(row['line'])}: {_size(row['bytes'])} in {row['arrays']} arrays")
    for tip in post.get("suggestions", [])[:4]:
        out.append(f"  next: {plain(tip)}")
    return out


def render_text(data: dict[str, Any]) -> str:
    """The recording in a few lines for a terminal."""
    s = data["summary"]
    lines = [f"recording {plain(data['folder'])}" + (" (rebuilt from its files: the run ended early)" if data["rebuilt"] else "")]
    if "exit_code" in s:
        lines[0] += f"; the program exited with {s['exit_code']}"
    lines += [f"  {line}" for line in device_lines(s)]
    if s.get("calls"):
        lines.append("  calls: " + ", ".join(f"{plain(k)} {v}" for k, v in sorted(s["calls"].items(), key=lambda kv: -kv[1])[:6]))
    lines += [f"  {line}" for line in leak_lines(s.get("leaks", {}))]
    for post in data["postmortems"]:
        lines += [f"  {line}" for line in postmortem_lines(post)]
    lines += beside_lines(data)
    lines += [f"  how: {plain(h)}" for h in s.get("how", [])]
    if not s.get("devices"):
        lines.append("  no device was read: the program did not start JAX's backends")
    return "\n".join(lines)


def beside_lines(data: dict[str, Any], most: int = 8) -> list[str]:
    """The device's peak after each recorded step beside jaxmem's pool prediction."""
    rows = data.get("beside") or []
    if not data.get("predicted"):
        return []
    p = data["predicted"]
    out = [f"  jaxmem's pool prediction for {plain(p['target'])} on {plain(p['device'])}: "
           + ", ".join(f"{_size(v)} after {k} step{'s' if k > 1 else ''}" for k, v in enumerate(p["peaks"], 1))]
    shown = rows if len(rows) <= most else rows[:most // 2] + rows[-most // 2:]
    for r in shown:
        out.append(f"  step {r['step']}: {r['device']} peak {r['device_peak']:,} B, predicted {r['predicted']:,} B, "
                   f"device / predicted {r['ratio']}")
    return out


def chart_svg(samples: list[dict[str, Any]], device: str, predicted: int | None = None, width: int = 900,
              height: int = 260) -> str:
    """An SVG line chart of one device's memory over the run: in use, and in use + reserved."""
    rows = [s for s in samples if s.get("device") == device]
    step = max(1, len(rows) // MAX_POINTS)
    rows = rows[::step]
    if not rows:
        return ""
    key = "bytes_in_use" if "bytes_in_use" in rows[0] else "live_array_bytes"
    used = [int(r.get(key, 0)) for r in rows]
    both = [int(r.get(key, 0)) + int(r.get("bytes_reserved", 0)) for r in rows]
    peaks = [int(r.get("peak_bytes_in_use", 0)) + int(r.get("peak_bytes_reserved", 0)) for r in rows]
    top = max([1, *both, *peaks, predicted or 0])
    t_end = max(float(rows[-1]["t"]), 1e-9)

    def points(values: list[int]) -> str:
        return " ".join(f"{40 + float(r['t']) / t_end * (width - 50):.1f},{height - 20 - v / top * (height - 40):.1f}"
                        for r, v in zip(rows, values))
    lines = [f'<polyline class="used" fill="none" stroke="#1f77b4" points="{points(used)}"/>',
             f'<polyline class="reserved" fill="none" stroke="#ff7f0e" points="{points(both)}"/>']
    if any(peaks):
        lines.append(f'<polyline class="peak" fill="none" stroke="#999" stroke-dasharray="2,2" points="{points(peaks)}"/>')
    if predicted:
        y = height - 20 - predicted / top * (height - 40)
        lines.append(f'<line class="predicted" x1="40" x2="{width - 10}" y1="{y:.1f}" y2="{y:.1f}" stroke="#2ca02c" '
                     f'stroke-dasharray="6,3"/><text x="{width - 10}" y="{y - 4:.1f}" text-anchor="end" font-size="11">'
                     f'jaxmem pool prediction {html.escape(_size(predicted))}</text>')
    label = f'<text x="40" y="12" font-size="12">{html.escape(device)}: in use (blue), in use + reserved (orange), ' \
            f'running peak (grey); top {html.escape(_size(top))}</text>'
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">{label}{"".join(lines)}</svg>'


def _by_line_rows(by_line: dict[str, Any] | list[dict[str, Any]]) -> list[list[str]]:
    if isinstance(by_line, dict):
        return [[line, _size(b), str(c)] for line, (b, c) in list(by_line.items())[:30]]
    return [[r["line"], _size(r["bytes"]), str(r["arrays"])] for r in by_line[:30]]


def _peak_profile(profiles: list[dict[str, Any]]) -> dict[str, Any] | None:
    kept = [p for p in profiles if p.get("why") != "oom"]
    return max(kept, key=lambda p: p.get("buffer_bytes", 0), default=None)


def render_html(data: dict[str, Any], predicted: dict[str, int] | None = None) -> str:
    """The recording as one self-contained HTML page. `predicted`: per device, jaxmem's pool peak."""
    s = data["summary"]
    parts = [f"<h1>jaxmem recording</h1><p>{html.escape(data['folder'])}</p>"]
    parts += [f"<p>{html.escape(line)}</p>" for line in device_lines(s)]
    if predicted is None and data.get("predicted"):
        predicted = {d: max(data["predicted"]["peaks"]) for d in s.get("devices", {}) if not d.startswith("cpu")}
    for device in s.get("devices", {}):
        parts.append(chart_svg(data["samples"], device, (predicted or {}).get(device)))
    if data.get("beside"):
        parts.append(render_table("The device's peak after each step beside jaxmem's pool prediction",
                                  ["step", "device", "device peak (in use + reserved)", "predicted", "device / predicted"],
                                  [[str(r["step"]), r["device"], f"{r['device_peak']:,}", f"{r['predicted']:,}", str(r["ratio"])]
                                   for r in data["beside"]]))
    peak = _peak_profile(data["profiles"])
    if peak:
        parts.append(render_table(f"Live arrays by line at the largest profile ({peak.get('why')}, t={peak.get('t')} s)",
                                  ["line", "bytes", "arrays"], _by_line_rows(peak.get("by_line", {}))))
    for i, post in enumerate(data["postmortems"], 1):
        parts.append(render_table(f"Out of memory {i}", ["what", "value"], [[line, ""] for line in postmortem_lines(post)]))
        parts.append(render_table(f"Live arrays by line at out of memory {i}", ["line", "bytes", "arrays"],
                                  _by_line_rows(post.get("held", {}).get("by_line", []))))
    parts.append(render_table("Leaks", ["finding"], [[line] for line in leak_lines(s.get("leaks", {}))] or [["none found"]]))
    parts.append(render_table("Programs compiled", ["program", "arguments", "outputs", "temporaries", "code"],
                              [[p.get("name", "?"), _size(p.get("argument_size_in_bytes")), _size(p.get("output_size_in_bytes")),
                                _size(p.get("temp_size_in_bytes")), _size(p.get("generated_code_size_in_bytes"))]
                               for p in s.get("programs", [])[:200]]))
    parts.append(render_table("How it was read", ["note"], [[h] for h in s.get("how", [])]))
    style = "body{font-family:sans-serif;margin:20px}table.static{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px}"
    return f"<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>jaxmem recording</title><style>{style}</style></head>" \
           f"<body>{''.join(parts)}</body></html>"
