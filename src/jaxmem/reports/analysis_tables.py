"""The terminal view of `jaxmem analyze`'s report: rich tables drawn from `AnalysisReport.data`
alone (the same dict `--json` prints).

    render_report(report, console)

The summary table (jaxmem's peak beside XLA's figures, the pool verdict, the plan and the
device), the largest buffers live at jaxmem's peak, the buffers XLA:GPU or XLA:TPU holds at its
peak, and `--execute`'s comparison with jax.jit.
"""

from __future__ import annotations

from typing import Any

from jaxmem.reports.analysis import AnalysisReport
from jaxmem.reports.escape import markup
from jaxmem.reports.terminal import shape_text, short_label, short_op, short_source
from jaxmem.units import format_size


def render_report(report: AnalysisReport, console: Any) -> None:
    """The whole report as tables on `console`; `--execute`'s tables when it ran."""
    data = report.data
    render(data, console)
    if "execute" in data:
        planned = data["peak_bytes"] if data["peak_bytes"] is not None else data.get("plan_withheld", {}).get("peak_bytes")
        render_execute(data["execute"], data["eager"], planned, console)


def _size(n: int | None) -> str:
    return "—" if n is None else format_size(n)


def _trace_note(data: dict[str, Any]) -> str:
    trace = data.get("trace_seconds")
    return f" (+{trace:.2f} s tracing)" if isinstance(trace, (int, float)) else ""


def render(data: dict[str, Any], console: Any) -> None:
    """The analysis as rich tables on `console` (a program with no plan: its note, and XLA's)."""
    if data.get("plan_note"):
        console.print(f"[yellow]{markup(data['plan_note'])}[/]")
    console.print(summary_table(data))
    if data.get("framework"):
        from jaxmem.reports.framework_tables import render_framework

        xla = data.get("xla_tpu") or data.get("xla_gpu")
        where = f"{'XLA:TPU' if data.get('xla_tpu') else 'XLA:GPU'} {data['device']['name']}" if xla else "XLA:CPU"
        render_framework(data["framework"], where, console)
    if data["peak_bytes"] is not None:
        console.print()
        console.print(top_buffers_table(data, console.width))
    if data.get("xla_gpu_peak_buffers"):
        render_gpu_peak(data, console)
    if data.get("xla_tpu_peak_buffers"):
        render_gpu_peak(data, console, platform="tpu")


def summary_table(data: dict[str, Any]) -> Any:
    """The headline figures, one row each: jaxmem's peak, XLA's figures here and on the device,
    the prediction, the pool verdict, the bound, the plan and the device."""
    from rich.table import Table
    from rich.text import Text

    summary = Table(title=f"jaxmem analyze · {markup(data['target'])}", title_justify="left", show_header=False,
                    box=None, padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    summary.add_column(style="dim")
    planned = data["peak_bytes"] is not None
    # The device's own compile first: it is the program the device runs; jaxmem's plan after it.
    if data.get("xla_gpu"):
        add_gpu_rows(data["xla_gpu"], data["peak_bytes"], summary)
    if data.get("xla_tpu"):
        render_tpu_row(data["xla_tpu"], data["peak_bytes"], summary)
    if planned:
        summary.add_row("jaxmem peak", Text(_size(data["peak_bytes"]), style="bold green"),
                        f"arguments {_size(data['argument_bytes'])} + arena {_size(data['arena_bytes'])}")
    if data["xla_total_bytes"] is not None:
        add_xla_cpu_rows(data, summary)
    if data.get("predicted_xla"):
        add_predicted_row(data["predicted_xla"], data.get("xla_gpu"), summary)
    if data.get("pool"):
        add_pool_row(data["pool"], summary)
    if data.get("loop"):
        summary.add_row("loop", f"{len(data['loop'])} programs",
                        "; ".join(f"{markup(p['target'])} {_size(p['total_bytes'])}" for p in data["loop"])
                        + ": the pool runs them in turn in one process")
    if planned:
        add_plan_rows(data, summary)
    return summary


def add_xla_cpu_rows(data: dict[str, Any], summary: Any) -> None:
    """XLA's total here (XLA:CPU), with its scheduler and what its figure leaves out."""
    from rich.text import Text

    ratio = data["ratio_to_xla"]
    style = "green" if ratio is not None and ratio <= 1.0 else "red"
    summary.add_row("XLA total here", _size(data["xla_total_bytes"]),
                    Text(f"{ratio:.3f}x of XLA ({data['xla']['scheduler']} scheduler)" if ratio is not None
                         else f"({data['xla']['scheduler']} scheduler)" if data["peak_bytes"] is None
                         else f"XLA holds nothing ({data['xla']['scheduler']} scheduler)", style=style))
    totals = data.get("xla_cpu_schedulers")
    if totals and len(totals) > 1:
        summary.add_row("", "", "XLA:CPU's schedulers: " + ", ".join(f"{name} {_size(total)}" for name, total in
                                                                     totals.items()) + "; the lower is compared")
    elif data["xla"]["scheduler"] == "default":
        summary.add_row("", "", "XLA:CPU's memory-optimized scheduler may need less: --cpu-scheduler both "
                        "compares with both of its schedulers")
    if data["xla"]["library_hidden_bytes"]:
        summary.add_row("", "", f"XLA:CPU's YNNPACK fusions hold {_size(data['xla']['library_hidden_bytes'])} "
                        "of dot/conv results that its figure leaves out")


def _ratio(peak: int | None, total: int) -> str:
    """`jaxmem 0.987x of it; ` (nothing without a plan)."""
    return "" if peak is None else f"jaxmem {peak / total if total else 0.0:.3f}x of it; "


def add_gpu_rows(gpu: dict[str, Any], peak: int | None, summary: Any) -> None:
    """XLA:GPU's figures from its deviceless compile, and its note."""
    from rich.text import Text

    summary.add_row(f"XLA:GPU {gpu['target']}", Text(_size(gpu["total_bytes"]), style="bold"),
                    f"arguments {_size(gpu['argument_bytes'])} + outputs {_size(gpu['output_bytes'])} + temp "
                    f"{_size(gpu['temp_bytes'])} - aliased {_size(gpu['alias_bytes'])}; {_ratio(peak, gpu['total_bytes'])}"
                    + ("cached" if gpu.get("cached") else f"compiled deviceless in {gpu['compile_seconds']:.1f} s"))
    if gpu.get("note"):
        summary.add_row("", "", Text(gpu["note"][:160], style="yellow"))


def render_tpu_row(tpu: dict[str, Any], peak: int | None, summary: Any) -> None:
    """XLA:TPU's figures (or its refusal) as one row of the summary table."""
    from rich.text import Text

    how = "cached" if tpu.get("cached") else f"compiled deviceless in {tpu['compile_seconds']:.1f} s"
    if tpu.get("oom"):
        summary.add_row(f"XLA:TPU {tpu['target']}", Text("does not fit", style="bold red"),
                        markup(f"{tpu['oom'][:200]} ({how})"))
        return
    summary.add_row(f"XLA:TPU {tpu['target']}", Text(_size(tpu["total_bytes"]), style="bold"),
                    f"arguments {_size(tpu['argument_bytes'])} + outputs {_size(tpu['output_bytes'])} + temp "
                    f"{_size(tpu['temp_bytes'])} - aliased {_size(tpu['alias_bytes'])}; code "
                    f"{_size(tpu['generated_code_bytes'])} beside it; {_ratio(peak, tpu['total_bytes'])}{how}")


def add_predicted_row(predicted: dict[str, Any], gpu: dict[str, Any] | None, summary: Any) -> None:
    """jaxmem's prediction of XLA:GPU's figures, against XLA:GPU's own where compiled."""
    against = f"; {predicted['total_bytes'] / gpu['total_bytes']:.3f}x of XLA:GPU's" if gpu and gpu["total_bytes"] else ""
    summary.add_row(f"predicted XLA:GPU {predicted['device']}", _size(predicted["total_bytes"]),
                    f"arguments {_size(predicted['argument_bytes'])} + outputs {_size(predicted['output_bytes'])} "
                    f"+ temp {_size(predicted['temp_bytes'])} - aliased {_size(predicted['alias_bytes'])}, "
                    f"jaxmem's model of XLA:GPU's fusion in {predicted['seconds']:.2f} s{against}")


def add_pool_row(pool: dict[str, Any], summary: Any) -> None:
    """The pool verdict over N steps: its peak and headroom, or where and why it ran out."""
    from rich.text import Text

    on = {"xla_gpu": "XLA:GPU", "xla_tpu": "XLA:TPU",
          "predicted_xla_gpu": "the predicted XLA:GPU"}.get(pool.get("judged_on"), "XLA:CPU")
    mode = ("TPU runtime: no preallocation, temporaries reserved, code resident" if pool.get("rules") == "tpu_runtime"
            else f"{pool['allocator']}, preallocate {str(pool['preallocate']).lower()}, "
                 f"fraction {pool['mem_fraction']:g}")
    if pool.get("factory_programs"):
        mode += (f"; with the code of the {pool['factory_programs']} programs your factory ran on the chip, "
                 f"{_size(pool['factory_code_bytes'])}: build the state under jax.jit to leave less")
    if pool["fits"]:
        summary.add_row("pool", Text("fits", style="bold green"),
                        f"{pool['steps']} steps of {on}'s buffers: peak {_size(pool['peak_bytes'])} of limit "
                        f"{_size(pool['limit_bytes'])}, headroom {_size(pool['headroom_bytes'])} ({mode})")
    else:
        why = "fragmentation: the free bytes add up, no block is large enough" if pool["fragmentation"] else "out of memory"
        where = "the arguments alone" if pool["failed_step"] == 0 else f"step {pool['failed_step']} of {pool['steps']}"
        summary.add_row("pool", Text("does not fit", style="bold red"),
                        f"{where}: {pool['failed_allocation']} "
                        f"({_size(pool['failed_bytes'])}) under limit {_size(pool['limit_bytes'])}; {why} ({mode})")


def add_plan_rows(data: dict[str, Any], summary: Any) -> None:
    """The lower bound, the outputs, the plan's verdict, the device's fit and unknown primitives."""
    from rich.text import Text

    on_tpu = data["device"].get("pool_rules") == "tpu_runtime"
    # On a TPU, jaxmem's plan knows nothing of XLA:TPU's fusion and on-chip memory: its bound is
    # the unfused plan's, and says nothing of what the chip needs (the pool row does).
    summary.add_row("plan's lower bound" if on_tpu else "lower bound", _size(data["lower_bound_bytes"]),
                    f"gap {100 * data['gap_to_lower_bound']:.2f}% (program order: "
                    f"{_size(data['program_order_lower_bound_bytes'])})"
                    + ("; of jaxmem's unfused plan, no bound on XLA:TPU's" if on_tpu else ""))
    summary.add_row("outputs", _size(data["output_bytes"]),
                    f"donated arguments: {', '.join(map(str, data['donated'])) or 'none'}")
    verdict = Text("valid", style="green") if data["valid"] else Text("INVALID", style="bold red")
    summary.add_row("plan", verdict,
                    f"{data['num_eqns']} equations, {data['num_buffers']} buffers, planned in "
                    f"{data['plan_seconds']:.2f} s{_trace_note(data)}; "
                    f"schedule {data['scheduler'] or '?'}, placement {data['placement'] or '?'}")
    dev = data["device"]
    if on_tpu and dev["fits"] is None:
        summary.add_row("jaxmem's plan", _size(data["peak_bytes"]),
                        f"no verdict on {dev['name']}: planned without XLA:TPU's fusion and on-chip memory; "
                        "the pool row is the chip's")
    else:
        _add_device_row(data, dev, summary)
    unknown = data["unknown_primitives"]
    summary.add_row("unknown primitives", Text(str(len(unknown)), style="yellow" if unknown else ""),
                    ", ".join(unknown) + (" (planned conservatively)" if unknown else ""))


def _add_device_row(data: dict[str, Any], dev: dict[str, Any], summary: Any) -> None:
    """Whether jaxmem's plan fits the device's memory (the GPU client's preallocated share)."""
    from rich.text import Text

    fit = Text("fits", style="bold green") if dev["fits"] else Text("does not fit", style="bold red")
    if dev.get("pool_rules") == "tpu_runtime":
        held = (f"{dev['name']}: {_size(dev['capacity_bytes'])}, all of it a program's (JAX's TPU runtime "
                "preallocates nothing; XLA_PYTHON_CLIENT_* are the GPU client's)")
    else:
        held = (f"{dev['name']}: {_size(dev['capacity_bytes'])}, JAX preallocates "
                f"{int(100 * dev['preallocated_fraction'])}% = {_size(dev['usable_bytes'])}")
    summary.add_row("jaxmem's plan" if data.get("pool") else "device", fit, held)
    if dev.get("chosen_because"):
        summary.add_row("judged for", dev["name"], markup(dev["chosen_because"]))


def top_buffers_table(data: dict[str, Any], width: int) -> Any:
    """The largest buffers live at jaxmem's peak, for a console `width` columns wide."""
    from rich import box
    from rich.table import Table

    where = "on entry" if data["peak_step"] < 0 else f"step {data['peak_step']}"
    narrow = width < 120  # a piped report or a small terminal: one line a row
    # Below 100 columns the borders and the row number are what no longer fit.
    tight = width < 100
    table = Table(title=f"Largest buffers live at the peak ({where})", title_justify="left",
                  box=box.SIMPLE_HEAD if tight else box.HEAVY_HEAD, padding=(0, 0 if tight else 1),
                  show_edge=not tight)
    if not tight:
        table.add_column("#", justify="right", style="dim", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("array", overflow="fold")
    table.add_column("category", no_wrap=True)
    table.add_column("made by", overflow="fold")
    # Source lines come from the user's frames; a model whose code has none gets no empty column.
    with_source = any(row["source"] for row in data["top_buffers"])
    if with_source:
        table.add_column("source line", overflow="fold")
    for i, row in enumerate(data["top_buffers"], 1):
        cells = [*([] if tight else [str(i)]), _size(row["size_bytes"]), shape_text(row["shape"], row["dtype"]),
                 row["category"] or row["kind"], short_label(row["label"], narrow)]
        source = short_source(row["source"], narrow) if row["source"] else "—"
        table.add_row(*map(markup, cells), *([markup(source)] if with_source else []))
    return table


def render_gpu_peak(data: dict[str, Any], console: Any, platform: str = "gpu") -> None:
    """XLA:GPU's (or XLA:TPU's) largest buffers live at its peak, as a rich table."""
    from rich.table import Table

    console.print()
    live = data.get(f"xla_{platform}_peak_live_bytes")
    title = f"What XLA:{platform.upper()} holds at its peak on {data[f'xla_{platform}']['target']}"
    if live:
        title += f" ({_size(live)} live there)"
    narrow = console.width < 140
    table = Table(title=title, title_justify="left")
    table.add_column("#", justify="right", style="dim", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("array", overflow="fold")
    table.add_column("kind", no_wrap=True)
    table.add_column("jaxpr array", overflow="fold")
    table.add_column("XLA op", overflow="fold")
    table.add_column("source line", overflow="fold")
    for i, row in enumerate(data[f"xla_{platform}_peak_buffers"], 1):
        op = short_op(row["op_name"]) or row["hlo"]
        cells = [str(i), _size(row["size_bytes"]), shape_text(row["shape"], row["dtype"]), row["kind"],
                 short_label(row["jaxpr_array"], narrow) or "—", "…" + op[-27:] if narrow and len(op) > 28 else op,
                 short_source(row["source"], narrow) if row["source"] else "—"]
        table.add_row(*map(markup, cells))
    console.print(table)


def render_execute(execute: dict[str, Any], eager: list[dict[str, Any]], planned_peak: int, console: Any) -> None:
    """`--execute` results as rich tables; eager peaks are also shown against the planned peak."""
    from rich.table import Table

    console.print()
    run = Table(title="Planned execution against jax.jit", title_justify="left")
    for col in ("results", "max abs err", "rel err", "tolerance", "JAX op by op", "planned", "jax.jit"):
        run.add_column(col, justify="right")
    tol, noise = execute.get("tolerance"), execute.get("noise_rel")
    run.add_row("equal" if execute.get("ok") else "DIFFER", f"{execute.get('max_abs_err', 0.0):.3g}",
                f"{execute.get('max_rel_err', 0.0):.3g}", "exact" if tol is None else f"{tol:.3g}",
                "—" if noise is None else f"{noise:.3g}", f"{execute.get('seconds', 0.0):.3f} s",
                f"{execute.get('jax_jit_seconds', 0.0):.3f} s")
    console.print(run)
    if tol is not None:
        console.print(f"[dim]rel err: the worst output's largest error over its largest magnitude; tolerance: "
                      f"{execute.get('reduction', 1):,}-term sums in its dtype"
                      f"{'' if noise is None else ', or 4x JAX op by op against jax.jit'}[/dim]")
    console.print()
    table = Table(title="Eager (op by op) under each allocator", title_justify="left")
    for col in ("allocator", "peak in use", "vs planned", "pool", "largest free", "fragmentation", "allocs",
                "device allocs", "fits"):
        table.add_column(col, justify="right" if col != "allocator" else "left")
    for row in eager:
        frag = row.get("fragmentation_at_peak")
        in_use = row.get("peak_bytes_in_use")
        versus = f"{in_use / planned_peak:.2f}x" if isinstance(in_use, (int, float)) and planned_peak else "—"
        table.add_row(str(row.get("allocator", "?")), _size(in_use), versus,
                      _size(row.get("peak_pool_bytes")), _size(row.get("largest_free_block_bytes")),
                      "—" if frag is None else f"{100 * frag:.1f}%", str(row.get("num_allocs", "—")),
                      str(row.get("device_allocs", "—")), "yes" if row.get("fits") else "no")
    console.print(table)
