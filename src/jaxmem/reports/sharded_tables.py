"""The tables of a sharded analysis (`jaxmem analyze` on a mesh, `jaxmem.analyze` of sharded
arguments): per device XLA's figures beside jaxmem's plan, the pool's verdict, what is
replicated, the buffers at each peak; and `--compare-shardings`' one row per layout."""

from __future__ import annotations

from typing import Any

from jaxmem.units import format_size


def _mesh_text(mesh: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in mesh.items())


def render(data: dict[str, Any], console: Any) -> None:
    """One sharded analysis as rich tables."""
    from rich.markup import escape
    from rich.table import Table

    from jaxmem.reports.terminal import shape_text, short_op, short_source

    key = next(k for k in ("xla_gpu", "xla_tpu", "xla_cpu") if k in data)
    xla = data[key]
    who = {"xla_gpu": f"XLA:GPU ({xla['target']})", "xla_tpu": f"XLA:TPU ({xla['target']}, {xla.get('topology', '')})"
           }.get(key, "XLA:CPU (host devices)")
    console.print(f"[bold]{escape(data['target'])}[/] on {data['devices']} devices ({_mesh_text(data['mesh'])})"
                  + (f", layout {data['layout']}" if data.get("layout") else ""))
    table = Table(title="Per device", title_justify="left")
    for column in ("", "argument", "output", "temp", "alias", "total"):
        table.add_column(column, justify="right")
    table.add_row(who, *(format_size(xla[k]) for k in ("argument_bytes", "output_bytes", "temp_bytes",
                                                       "alias_bytes", "total_bytes")))
    plan = data["plan"]
    if plan.get("withheld"):
        table.add_row("jaxmem plan", "", "", "", "", "not shown")
    elif data["peak_bytes"] is None:
        table.add_row("jaxmem plan", "", "", "", "", "not made")
    else:
        table.add_row(f"jaxmem plan ({plan['method']})", "", "", "", "", format_size(data["peak_bytes"]))
    console.print(table)
    if plan.get("withheld"):
        console.print(escape(plan["withheld"]))
    if data.get("cached"):
        console.print("cached: XLA's figures and jaxmem's plan from an earlier compile of this program")
    if data.get("pool_line"):
        console.print(f"{'chip' if key == 'xla_tpu' else 'pool'} per device ({data['device']}): "
                      f"{escape(data['pool_line'])}")
    if data["replicated"]:
        rep = Table(title=f"Replicated (> 1 MiB per device): {format_size(data['replicated_bytes'])} per device",
                    title_justify="left")
        for column, justify in (("argument", "left"), ("per device", "right"), ("over axis", "left"),
                                ("sharding it saves", "right")):
            rep.add_column(column, justify=justify, overflow="fold")
        for row in data["replicated"][:10]:
            rep.add_row(escape(row["path"]), format_size(row["bytes"]), row["axis"], format_size(row["saved_bytes"]))
        console.print(rep)
    if plan.get("top"):
        top = Table(title="Largest buffers live at jaxmem's per-device peak", title_justify="left")
        for column in ("size", "array", "kind", "made by", "source line"):
            top.add_column(column, overflow="fold")
        for row in plan["top"]:
            top.add_row(format_size(row["size_bytes"]), shape_text(row["shape"], row["dtype"]), row["kind"],
                        escape(row["label"]), escape(short_source(row["source"])) or "—")
        console.print(top)
    peak = data.get(f"{key}_peak_buffers") or []
    if peak:
        gpu = Table(title=f"What {who.split(' (')[0]} holds at its peak, per device", title_justify="left")
        for column in ("size", "array", "kind", "XLA op", "source line"):
            gpu.add_column(column, overflow="fold")
        for row in peak:
            gpu.add_row(format_size(row["size_bytes"]), shape_text(row["shape"], row["dtype"]), row["kind"],
                        escape(short_op(row["op_name"]) or row["name"]), escape(short_source(row["source"])) or "—")
        console.print(gpu)


def render_compare(data: dict[str, Any], console: Any) -> None:
    """`--compare-shardings`: one row per layout."""
    from rich.markup import escape
    from rich.table import Table

    from jaxmem.xla.sharding import LAYOUT_NAMES

    table = Table(title=f"{escape(data['target'])} on a {data['mesh']} mesh of {escape(data['device'])}: per device",
                  title_justify="left")
    for column, justify in (("layout", "left"), ("XLA total", "right"), ("jaxmem plan", "right"),
                            ("replicated", "right"), ("pool", "left"), ("compile", "right")):
        table.add_column(column, justify=justify, overflow="fold")
    for row in data["layouts"]:
        xla = row.get("xla_gpu") or row.get("xla_tpu") or row.get("xla_cpu")
        pool = row["pool"]
        verdict = "—" if pool is None else ("[green]fits[/]" if pool["fits"] else "[red]does not fit[/]")
        table.add_row(LAYOUT_NAMES.get(row["layout"], row["layout"]), format_size(xla["total_bytes"]),
                      "not shown" if row["plan"].get("withheld") else "not made" if row["peak_bytes"] is None
                      else format_size(row["peak_bytes"]),
                      format_size(row["replicated_bytes"]), verdict,
                      "cached" if row.get("cached") else f"{xla['compile_seconds']:.1f} s")
    console.print(table)
    fitting = [row["layout"] for row in data["layouts"] if row["pool"] and row["pool"]["fits"]]
    if fitting:
        console.print(f"fits with: {', '.join(LAYOUT_NAMES[f] for f in fitting)}")
    else:
        console.print("[red]no standard layout fits[/]")
