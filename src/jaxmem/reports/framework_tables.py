"""The terminal view of what a step's framework adds over the same step written pure, and of the
changes that remove it: drawn from the report's `framework` dict alone.

    render_framework(data["framework"], device_name, console)
"""

from __future__ import annotations

from typing import Any

from jaxmem.reports.escape import markup
from jaxmem.reports.terminal import short_source
from jaxmem.units import format_size


def _size(n: int | None) -> str:
    return "—" if n is None else format_size(n)


def render_framework(framework: dict[str, Any], device: str, console: Any) -> None:
    """Whose program it is and how it was read; what the framework adds, by line and by array;
    each change with its code, the pool's peak after it and whether its results are the same."""
    from rich.table import Table

    console.print()
    head = Table(title=f"What {markup(framework['name'])} adds to {markup(framework['step'])} over the same step "
                       "written pure", title_justify="left", show_header=False, box=None, padding=(0, 2))
    head.add_column(style="bold")
    head.add_column(justify="right")
    head.add_column(overflow="fold")
    if framework.get("how"):
        head.add_row("read as", "", markup(framework["how"]))
    if "adds" not in framework:
        console.print(head)
        return
    before, pure = framework.get("pool_peak_bytes"), framework.get("pure_pool_peak_bytes")
    if before is not None:
        added = framework.get("added_bytes") or 0
        head.add_row("pool peak", _size(before), f"written pure (the best change below): {_size(pure)}, "
                                                 f"{_size(added)} less" if added else "no change below lowers it")
    for item in framework["adds"]:
        head.add_row(item["what"], _size(item["bytes"]), f"{item['arrays']} arrays: {markup(item['why'])}"
                     if item["arrays"] else "none")
        for line in item.get("lines", [])[:5]:
            head.add_row("", _size(line["bytes"]), f"{markup(short_source(line['source']))} ({line['arrays']} arrays)")
        for copy in item.get("copies", [])[:5]:
            head.add_row("", _size(copy["bytes"]), markup(copy["array"]))
    console.print(head)
    if framework.get("changes"):
        console.print(changes_table(framework["changes"], device))


def changes_table(changes: list[dict[str, Any]], device: str) -> Any:
    """One row per change: the code to paste, XLA's total and the pool's peak after it, what it
    saves, and whether the results are the same."""
    from rich.table import Table

    table = Table(title=f"Changes, each compiled for {markup(device)} and run through the same pool",
                  title_justify="left")
    table.add_column("change", overflow="fold")
    table.add_column("XLA total", justify="right")
    table.add_column("pool peak", justify="right")
    table.add_column("saves", justify="right")
    table.add_column("results", overflow="fold")
    for row in changes:
        if "error" in row:
            table.add_row(markup(row["code"]), "—", "—", "—", markup(row["error"]))
            continue
        same = row.get("same_results")
        verdict = {True: "same", False: "DIFFERENT", None: "unchecked"}[same]
        saves = _size(row.get("saved_bytes")) if row.get("lowers_peak") else "nothing"
        table.add_row(f"{markup(row['code'])}\n[dim]{markup(row['title'])}[/]", _size(row["xla"]["total_bytes"]),
                      _size(row.get("pool_peak_bytes")), saves,
                      f"{verdict}: {markup(row.get('results_note', ''))}")
    return table
