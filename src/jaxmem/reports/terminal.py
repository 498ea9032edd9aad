"""Terminal output with rich: tables of sizes, the cells the commands' tables share (an argument's
path, a source line, an HLO op, an array's dtype and shape), and progress for work that takes over
a second.

    print_table("Largest buffers at the peak", ["size", "source"], rows)
    with progress("replaying", total=len(events)) as advance:
        for event in events:
            ...
            advance(1)
    with busy("planning"):
        plan = planner.plan(fn, *args)

The progress bar and the spinner appear only when the work has run for `DELAY` seconds and
stderr is a terminal, so quick commands and piped output (`--json`) stay clean.
"""

from __future__ import annotations

import os
import re
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from rich.console import Console
from rich.table import Table

from jaxmem.reports.data import ReportData
from jaxmem.reports.escape import markup
from jaxmem.units import format_size

DELAY = 1.0


def console(stderr: bool = False) -> Console:
    """A rich console on stdout (or stderr), at the terminal's width."""
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


def make_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]], numeric: Sequence[str] = ()) -> Table:
    """A rich table; the columns named in `numeric` are right-aligned. The title and cells are
    text, not markup: names from user code and trace files are shown as they are.

    >>> console().print(make_table("peaks", ["allocator", "peak"], [["bfc", "1.00 GiB"]], numeric=["peak"]))
    ... # doctest: +NORMALIZE_WHITESPACE
    peaks
    ┏━━━━━━━━━━━┳━━━━━━━━━━┓
    ┃ allocator ┃     peak ┃
    ┡━━━━━━━━━━━╇━━━━━━━━━━┩
    │ bfc       │ 1.00 GiB │
    └───────────┴──────────┘
    """
    table = Table(title=markup(title), title_justify="left", header_style="bold")
    for name in columns:
        table.add_column(markup(name), justify="right" if name in numeric else "left", overflow="fold")
    for row in rows:
        table.add_row(*(markup(cell) for cell in row))
    return table


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]],
                numeric: Sequence[str] = (), out: Console | None = None) -> None:
    """Print `make_table(...)` on stdout (or `out`)."""
    (out or console()).print(make_table(title, columns, rows, numeric))


def short_label(label: str, narrow: bool = False) -> str:
    """An argument's pytree path as a table shows it: `['k']` keys as `.k`; when `narrow`, the
    last two keys only.

    >>> short_label("args[1][0].nu['params']['Dense_1']['kernel']")
    'args[1][0].nu.params.Dense_1.kernel'
    >>> short_label("args[1][0].nu['params']['Dense_1']['kernel']", narrow=True)
    '….Dense_1.kernel'
    """
    text = re.sub(r"\['([A-Za-z_][A-Za-z0-9_]*)'\]", r".\1", label)
    if narrow and len(text) > 20 and text.count(".") >= 2:
        text = "…." + ".".join(text.split(".")[-2:])
    return text


def short_source(source: str, narrow: bool = False) -> str:
    """A source line as people read it in a table: relative to the working directory when under
    it, from the package folder for installed libraries and jaxmem's examples, else the last two
    folders of its path; when `narrow`, the file's name and line only.

    >>> short_source("/nowhere/deep/project/models/x.py:3 (f)")
    '…/models/x.py:3 (f)'
    >>> short_source("/v/lib/python3.11/site-packages/flax/linen/linear.py:287 (__call__)")
    'flax/linen/linear.py:287 (__call__)'
    >>> short_source("/nowhere/deep/project/models/x.py:3 (f)", narrow=True)
    'x.py:3'
    """
    if narrow and source.startswith("/") and " (" in source:
        return os.path.basename(source.rsplit(" (", 1)[0])
    if not source.startswith("/"):
        return source
    cwd = os.getcwd().rstrip("/") + "/"
    if source.startswith(cwd):
        return source[len(cwd):]
    for marker, keep in (("/site-packages/", ""), ("/dist-packages/", ""), ("/jaxmem/examples/", "jaxmem/examples/")):
        if marker in source:
            return keep + source.split(marker, 1)[1]
    parts = source.split("/")
    return "…/" + "/".join(parts[-2:]) if len(parts) > 3 else source


def shape_text(shape: Sequence[int], dtype: str) -> str:
    """An array as a table shows it, `float32[8,128]`; `—` for bytes with no dtype (a loop or
    cond body's scratch)."""
    if not dtype:
        return "—"
    return f"{dtype}[{','.join(str(d) for d in shape)}]"


def short_op(op_name: str) -> str:
    """An HLO op_name without its leading `jit(fn)/`, as the table shows it.

    >>> short_op("jit(train_step)/jvp()/dot_general")
    'jvp()/dot_general'
    """
    if op_name.startswith("jit(") and "/" in op_name:
        return op_name.split("/", 1)[1]
    return op_name


def top_blocks_rows(data: ReportData, count: int = 10, step: int | None = None) -> list[list[str]]:
    """Rows (size, category, dtype[shape], op, live, source) of the largest blocks live at a step."""
    x = data.peak_x if step is None else step
    rows = []
    for b in data.live_at(x)[:count]:
        rows.append([format_size(b.size), b.category.replace("_", " "), f"{b.dtype}[{','.join(map(str, b.shape))}]",
                     b.label, f"{b.start}..{b.end}", b.source or "unknown"])
    return rows


def print_report(data: ReportData, count: int = 10, out: Console | None = None) -> None:
    """The report's summary, bytes per category at the peak and the largest blocks there."""
    out = out or console()
    out.print(make_table(data.title, ["", ""], data.summary))
    i = data.peak_x - data.x_min
    cat_rows = [[c.replace("_", " "), format_size(data.stacked[c][i])] for c in data.categories if data.stacked[c][i]]
    out.print(make_table(f"At the peak ({data.x_label} {data.peak_x}), by category", ["category", "bytes"], cat_rows, ["bytes"]))
    out.print(make_table(f"Largest live at the peak ({data.x_label} {data.peak_x})",
                         ["size", "category", "dtype[shape]", "op", "live", "source"], top_blocks_rows(data, count), ["size"]))


@contextmanager
def progress(description: str, total: int, *, delay: float = DELAY, enabled: bool | None = None,
             out: Console | None = None) -> Iterator[Callable[[int], None]]:
    """Yield `advance(n)`; a bar on stderr appears once the work has run `delay` seconds.

    Args:
        description: what is being done ("replaying bfc").
        total: units of work (events, steps).
        delay: seconds before the bar shows.
        enabled: force on/off; by default on when stderr is a terminal.
        out: the console to draw on (default: stderr).
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    err = out or console(stderr=True)
    show = err.is_terminal if enabled is None else enabled
    state = {"done": 0, "bar": None, "task": None, "start": time.perf_counter(), "next_check": 0}

    def advance(n: int = 1) -> None:
        state["done"] += n
        bar = state["bar"]
        if bar is not None:
            bar.update(state["task"], completed=state["done"])
            return
        # Check the clock only now and then: advance() may be called a million times.
        if not show or state["done"] < state["next_check"]:
            return
        state["next_check"] = state["done"] + max(1, total // 1000)
        if time.perf_counter() - state["start"] >= delay:
            bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                           console=err, transient=True)
            bar.start()
            state["task"] = bar.add_task(description, total=total, completed=state["done"])
            state["bar"] = bar

    try:
        yield advance
    finally:
        if state["bar"] is not None:
            state["bar"].stop()


@contextmanager
def busy(description: str, *, delay: float = DELAY, enabled: bool | None = None,
         out: Console | None = None) -> Iterator[None]:
    """A spinner on stderr (or `out`) for work of unknown length, shown once it has run
    `delay` seconds."""
    err = out or console(stderr=True)
    show = err.is_terminal if enabled is None else enabled
    status = {"live": None}
    lock = threading.Lock()
    done = threading.Event()

    def start() -> None:
        with lock:
            if not done.is_set():
                status["live"] = err.status(description)
                status["live"].start()

    timer = threading.Timer(delay, start) if show else None
    if timer is not None:
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        with lock:
            done.set()
            if timer is not None:
                timer.cancel()
            if status["live"] is not None:
                status["live"].stop()
