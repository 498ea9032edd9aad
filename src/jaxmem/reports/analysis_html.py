"""An analysis (`AnalysisReport.data`, the dict `--json` prints) as an HTML fragment a notebook
shows inline: the verdict, the figures, the largest buffers at jaxmem's peak and at XLA's,
with their source lines. Self-contained (styles inline, no script, nothing fetched); every
name from user code is escaped (`html.render_table`, `escape.plain`).

    fragment = render_analysis(report.data)
"""

from __future__ import annotations

import html
from typing import Any

from jaxmem.reports.escape import plain
from jaxmem.reports.html import render_table
from jaxmem.reports.terminal import shape_text, short_op
from jaxmem.units import format_size

STYLE = (
    ".jaxmem-analysis{font:13px/1.4 system-ui,sans-serif;color:#1f2328;max-width:1100px}"
    ".jaxmem-analysis h2{font-size:14px;margin:14px 0 4px}"
    ".jaxmem-analysis table{border-collapse:collapse;margin:2px 0}"
    ".jaxmem-analysis td,.jaxmem-analysis th{border-bottom:1px solid #d0d7de;padding:2px 8px;text-align:left;"
    "vertical-align:top}"
    ".jaxmem-analysis .fits{color:#1a7f37;font-weight:600}.jaxmem-analysis .nofit{color:#cf222e;font-weight:600}"
    ".jaxmem-analysis .note{color:#9a6700}"
)


def _size(n: int | None) -> str:
    return "—" if n is None else format_size(n)


def _text(value: Any) -> str:
    return html.escape(plain(value))


def verdict(data: dict[str, Any]) -> str:
    """The headline: fits or not, on which device, judged by what."""
    device = data["device"]["name"]
    if data["fits"] is None:
        return f"<p>No verdict for <b>{_text(device)}</b>: no XLA figures or plan to judge by.</p>"
    pool = data.get("pool") or {}
    how = (f" over {pool['steps']} steps (peak {_size(pool['peak_bytes'])} of {_size(pool['limit_bytes'])})"
           if pool else "")
    word = '<span class="fits">fits</span>' if data["fits"] else '<span class="nofit">does not fit</span>'
    return f"<p><b>{_text(data['target'])}</b> {word} <b>{_text(device)}</b>{_text(how)}.</p>"


def figure_rows(data: dict[str, Any]) -> list[list[str]]:
    """One row per figure: XLA on the device (the program it runs) first, then jaxmem's plan,
    XLA here, the prediction, the pool."""
    rows = []
    for key in ("xla_gpu", "xla_tpu"):
        xla = data.get(key)
        if xla:
            name = "XLA:GPU" if key == "xla_gpu" else "XLA:TPU"
            rows.append([f"{name} {xla['target']}", "does not fit" if xla.get("oom") else _size(xla["total_bytes"]),
                         f"arguments {_size(xla['argument_bytes'])} + outputs {_size(xla['output_bytes'])} + temp "
                         f"{_size(xla['temp_bytes'])} - aliased {_size(xla['alias_bytes'])}"])
    if data["peak_bytes"] is not None:
        rows.append(["jaxmem plan (peak)", _size(data["peak_bytes"]),
                     f"lower bound {_size(data['lower_bound_bytes'])}; {data['num_eqns']} equations"])
    if data.get("xla"):
        rows.append(["XLA:CPU here", _size(data["xla_total_bytes"]), f"{data['xla']['scheduler']} scheduler"])
    if data.get("predicted_xla"):
        rows.append(["predicted XLA:GPU", _size(data["predicted_xla_bytes"]), "jaxmem's model of XLA:GPU's fusion"])
    if data.get("pool"):
        pool = data["pool"]
        rows.append(["pool", "fits" if pool["fits"] else "does not fit",
                     f"{pool['steps']} steps: peak {_size(pool['peak_bytes'])} of limit {_size(pool['limit_bytes'])}"])
    return rows


def buffer_rows(rows: list[dict[str, Any]], xla: bool) -> list[list[str]]:
    """The largest buffers, each with its array, what made it and the user's source line."""
    out = []
    for row in rows:
        made = (short_op(row.get("op_name", "")) or row.get("hlo", "")) if xla else row.get("label", "")
        out.append([_size(row["size_bytes"]), shape_text(row["shape"], row["dtype"]),
                    row.get("category") or row.get("kind", ""), plain(made), plain(row.get("source") or "—")])
    return out


def framework_rows(framework: dict[str, Any]) -> tuple[list[list[str]], list[list[str]]]:
    """What the framework adds (by line, by array) and each change that removes it."""
    adds = []
    for item in framework.get("adds", []):
        adds.append([plain(item["what"]), _size(item["bytes"]), plain(f"{item['arrays']} arrays: {item['why']}")])
        adds += [["", _size(line["bytes"]), plain(line["source"])] for line in item.get("lines", [])[:5]]
        adds += [["", _size(copy["bytes"]), plain(copy["array"])] for copy in item.get("copies", [])[:5]]
    changes = []
    for row in framework.get("changes", []):
        if "error" in row:
            changes.append([plain(row["code"]), "—", "—", plain(row["error"])])
            continue
        same = {True: "same", False: "DIFFERENT", None: "unchecked"}[row.get("same_results")]
        changes.append([plain(row["code"]), _size(row.get("pool_peak_bytes")),
                        _size(row.get("saved_bytes")) if row.get("lowers_peak") else "nothing",
                        plain(f"{same}: {row.get('results_note', '')}")])
    return adds, changes


def render_analysis(data: dict[str, Any]) -> str:
    """The whole analysis as one HTML fragment (a `<div>` with its own `<style>`)."""
    parts = [f"<div class=\"jaxmem-analysis\"><style>{STYLE}</style>", verdict(data)]
    for note in (data.get("plan_note"), data.get("xla_note")):
        if note:
            parts.append(f"<p class=\"note\">{_text(note)}</p>")
    parts.append(render_table("Figures", ["", "bytes", ""], figure_rows(data)))
    framework = data.get("framework")
    if framework and "adds" in framework:
        adds, changes = framework_rows(framework)
        parts.append(render_table(f"What {framework['name']} adds to {framework['step']} over the same step written pure",
                                  ["", "bytes", ""], adds))
        if changes:
            parts.append(render_table("Changes, each compiled and run through the same pool",
                                      ["change", "pool peak", "saves", "results"], changes))
    columns = ["size", "array", "kind", "made by", "source line"]
    if data["top_buffers"]:
        parts.append(render_table("Largest buffers live at jaxmem's peak", columns,
                                  buffer_rows(data["top_buffers"], xla=False)))
    for key, name in (("xla_gpu", "XLA:GPU"), ("xla_tpu", "XLA:TPU")):
        if data.get(f"{key}_peak_buffers"):
            parts.append(render_table(f"What {name} holds at its peak", columns,
                                      buffer_rows(data[f"{key}_peak_buffers"], xla=True)))
    parts.append("</div>")
    return "".join(parts)


def render_page(data: dict[str, Any]) -> str:
    """`render_analysis` as a whole page (to save, or open in a browser)."""
    title = _text(data["target"])
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>jaxmem: {title}</title></head><body>{render_analysis(data)}</body></html>\n")
