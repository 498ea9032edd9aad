"""Replay an allocation trace through PyTorch's caching allocator, XLA's BFC and others.

    jaxmem replay memory.pickle --allocator caching,bfc --capacity 80GiB
    jaxmem replay memory.pickle --json

TRACE is a PyTorch memory snapshot (.pickle), a PyTorch profiler Chrome trace with memory
events, an RMM log (CSV) or a jaxmem trace; the format is told from the file. Each allocator
replays the same allocations and frees from the trace's start state; the table shows its peak
in use, peak reserved, fragmentation at the in-use peak (reserved / in use, and XLA's
(free - largest free block) / free), its device allocations (cudaMalloc equivalents) during
the window, and the first out-of-memory with what was live then. For snapshots the recorded
allocator's own segment allocations are shown beside the model's.
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxmem.cli import OneLineParser, report_console
from jaxmem.errors import ConfigError
from jaxmem.units import format_size, parse_size


def _parser() -> argparse.ArgumentParser:
    from jaxmem.reports.cli import add_arguments
    from jaxmem.traces.replay import ALLOCATORS

    doc = (__doc__ or "").strip()
    p = OneLineParser(prog="jaxmem replay", description=doc.splitlines()[0],
                      epilog="\n".join(doc.splitlines()[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", metavar="TRACE", help="snapshot .pickle, Chrome trace .json, RMM .csv or jaxmem trace")
    p.add_argument("--allocator", default=",".join(ALLOCATORS),
                   help=f"comma-separated, from: {','.join(ALLOCATORS)} (default: all)")
    p.add_argument("--capacity", default=None,
                   help="device memory: bytes, '80GiB' or a preset like h100-80gb (default: the trace's device, else 80GiB)")
    p.add_argument("--format", default=None, help="trace format, to skip sniffing: torch-snapshot, chrome, rmm-csv, jaxmem")
    p.add_argument("--alloc-conf", default=None, metavar="CONF",
                   help="PYTORCH_CUDA_ALLOC_CONF for the caching models (default: the trace's own settings)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    add_arguments(p)
    return p


def _pct(x: float) -> str:
    return f"{x:.3f}"


def render_table(report, console) -> None:
    """Print the comparison table and the first out-of-memory of each allocator."""
    from rich.table import Table

    from jaxmem.reports.escape import markup

    title = f"{markup(report.source)}  ({markup(report.format)}, {report.events:,} events, capacity {format_size(report.capacity)})"
    table = Table(title=title, title_justify="left")
    for col in ("allocator", "peak in use", "peak reserved", "reserved/in use", "XLA frag",
                "device allocs", "device alloc bytes", "first OOM"):
        table.add_column(col, justify="left" if col in ("allocator", "first OOM") else "right",
                         no_wrap=col in ("allocator", "device allocs", "first OOM"))
    rec = report.recorded
    if rec is not None:
        table.add_row("recorded", "-", format_size(rec.peak_reserved_bytes), "-", "-", f"{rec.device_allocs:,}",
                      format_size(rec.device_alloc_bytes), "-", style="bold")
    for name, run in report.runs.items():
        oom = f"event {run.oom['event_index']}: {format_size(run.oom['request'])}" if run.oom else "-"
        same = ""
        if rec is not None and name == "caching" and not run.oom:
            same = " (=)" if (run.device_allocs, run.device_alloc_bytes) == (rec.device_allocs, rec.device_alloc_bytes) else " (differs)"
        table.add_row(name, format_size(run.peak_in_use_bytes), format_size(run.peak_reserved_bytes),
                      _pct(run.reserved_over_in_use), _pct(run.xla_fragmentation), f"{run.device_allocs:,}{same}",
                      format_size(run.device_alloc_bytes), oom)
    console.print(table)
    if report.settings:
        console.print(f"caching allocator settings: {markup(report.settings)}")
    for name, run in report.runs.items():
        if not run.oom:
            continue
        o = run.oom
        console.print(f"[bold]{name}[/]: out of memory at event {o['event_index']} asking for {format_size(o['request'])}; "
                      f"{format_size(o['in_use_bytes'])} in use in {o['live_blocks']:,} blocks, "
                      f"{format_size(o['reserved_bytes'])} reserved (limit {format_size(run.limit)}). Largest live:")
        for row in o["largest_live"][:5]:
            where = row.get("frame") or row.get("label") or ("before the window" if "event_index" not in row else f"event {row['event_index']}")
            console.print(f"    {format_size(row['size']):>12}  at {row['addr']:#x}  {markup(where)}")


def main(argv: list[str]) -> int:
    from jaxmem.reports.cli import check_paths, write_replay_reports
    from jaxmem.traces.readers import load_trace
    from jaxmem.traces.replay import ALLOCATORS, replay

    args = _parser().parse_args(argv)
    check_paths(args)   # `--png t.xyz` is refused before the trace is read
    names = [n.strip() for n in args.allocator.split(",") if n.strip()]
    if not names:
        raise ConfigError("--allocator: name at least one allocator")
    for n in names:
        if n not in ALLOCATORS:
            raise ConfigError(f"--allocator: unknown allocator {n!r}; one of: {', '.join(ALLOCATORS)}")
    capacity = parse_size(args.capacity) if args.capacity is not None else None
    trace = load_trace(args.trace, args.format)
    if capacity is None:
        capacity = trace.device_capacity or parse_size("80GiB")
    options = None
    if args.alloc_conf is not None:
        from jaxmem.runtime.caching_config import config_from_settings, parse_alloc_conf

        cfg = parse_alloc_conf(args.alloc_conf, config_from_settings(trace.allocator_settings or {}))
        options = {"caching": {"config": cfg}, "caching-expandable": {"config": cfg}}
    from jaxmem.reports.terminal import progress

    # The bar shows only once the replays have run a second, and only on a terminal.
    report = replay(trace, names, capacity=capacity, progress=progress if sys.stderr.isatty() else None,
                    options=options)
    if options is not None:
        report.settings = f"{options['caching']['config'].describe()} (from --alloc-conf)"
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        render_table(report, report_console())
    write_replay_reports(args, report, trace=trace)
    return 0
