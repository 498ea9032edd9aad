"""`jaxmem analyze` for sharded programs: memory per device on a mesh, what is replicated, and
which standard layout fits (`--compare-shardings`).

Used by `jaxmem analyze` when the factory's arguments carry a `NamedSharding` over more than one
device, or when `--mesh`, `--layout` or `--compare-shardings` is given:

    jaxmem analyze jaxmem.examples.sharded:fsdp_step --device h100-80gb
    jaxmem analyze jaxmem.examples.sharded:gpt_step --compare-shardings --mesh 4x2
"""

from __future__ import annotations

import argparse
import json
import time
from types import SimpleNamespace
from typing import Any, Sequence

from jaxmem.errors import ConfigError, PlanError
from jaxmem.units import format_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`analyze`'s mesh flags."""
    group = parser.add_argument_group("sharded programs (memory per device on a mesh)")
    group.add_argument("--mesh", default=None, metavar="8|4x2",
                       help="mesh axis sizes, axes named data (and model): for --layout and --compare-shardings")
    group.add_argument("--layout", default=None, choices=("dp", "fsdp", "fsdp_tp"),
                       help="lay out the factory's (params, opt_state, ..., batch) arguments: dp (state "
                            "replicated), fsdp (state sharded over data), fsdp_tp (and over model); the "
                            "last argument is the batch, sharded over data")
    group.add_argument("--compare-shardings", action="store_true",
                       help="per-device total and pool verdict under each standard layout")
    group.add_argument("--topology", default=None, metavar="v5e:2x4",
                       help="for a TPU preset: the TPU slice to compile the mesh on (default: the smallest "
                            "slice of the preset's chip that holds the mesh)")


def wanted(args: argparse.Namespace, fn_args: Sequence[Any]) -> bool:
    """Whether `analyze` takes the sharded path: a mesh flag, or a multi-device sharding."""
    from jaxmem.xla.sharding import find_mesh

    return bool(args.mesh or args.layout or args.compare_shardings) or find_mesh(fn_args) is not None


def _kind_or_cpu(kind: str, reason: str | None, forced: bool) -> tuple[str, str | None]:
    """`kind` ("gpu" or "tpu") where its compiler runs here; else an error when `--xla` asked
    for it (`forced`), or "cpu" with a note."""
    if not reason:
        return kind, None
    name = f"XLA:{kind.upper()}"
    if forced:
        raise PlanError(f"{name} is not available here: {reason}")
    return "cpu", f"{name} is not available here ({reason}); comparing with XLA:CPU on host devices"


def _xla_kind(args: argparse.Namespace, device: str) -> tuple[str, str | None]:
    """("gpu", "tpu" or "cpu", a note when XLA:GPU or XLA:TPU was wanted but is not available)."""
    from jaxmem.accelerators import find
    from jaxmem.xla.gpu.compile import spec_for, unavailable_reason

    accelerator = find(device)
    if args.topology and (accelerator is None or not accelerator.is_tpu):
        raise PlanError(f"--topology is for a TPU preset, not {device!r}")
    if accelerator is not None and accelerator.is_tpu and args.xla in ("auto", "tpu"):
        from jaxmem.xla.tpu.compile import unavailable_reason as tpu_reason

        return _kind_or_cpu("tpu", tpu_reason(), args.xla == "tpu")
    if args.xla == "tpu":
        raise PlanError(f"--xla tpu needs a TPU preset, not {device!r}")
    if args.xla == "cpu" or spec_for(device) is None:
        if args.xla == "gpu":
            raise PlanError(f"--xla gpu needs a GPU preset with an XLA target description, not {device!r}")
        return "cpu", None
    return _kind_or_cpu("gpu", unavailable_reason(), args.xla == "gpu")


def pool_verdict(ref: dict[str, Any], dev: Any, steps: int) -> Any:
    """The per-device pool across `steps` training steps, from a sharded reference (per chip,
    under the TPU runtime's rules, for an XLA:TPU reference)."""
    from jaxmem.runtime.steps import program_from_reference, simulate_steps

    view = SimpleNamespace(arguments=ref["arguments"], outputs=ref["outputs"], temp_bytes=ref["xla"]["temp_bytes"])
    if ref["xla_kind"] == "tpu":
        from jaxmem.accelerators import resolve
        from jaxmem.runtime.tpu_pool import simulate_tpu_steps

        return simulate_tpu_steps(program_from_reference(view), resolve(ref["xla"]["target"]).capacity_bytes, steps,
                                  code_bytes=ref["xla"].get("generated_code_bytes", 0))
    return simulate_steps(program_from_reference(view), dev, steps)


def summarize(ref: dict[str, Any], pool: Any, *, target: str, device: tuple[str, int]) -> dict[str, Any]:
    """The JSON object of one sharded analysis."""
    key = {"gpu": "xla_gpu", "tpu": "xla_tpu"}.get(ref["xla_kind"], "xla_cpu")
    return {
        "target": target, "device": device[0], "capacity_bytes": device[1], "devices": ref["devices"],
        "mesh": ref["mesh"], "layout": ref.get("layout"), "cached": bool(ref.get("cached")),
        key: ref["xla"], "peak_bytes": ref["peak_bytes"],
        "plan": ref["plan"], "replicated_bytes": ref["replicated_bytes"], "replicated": ref["replicated"],
        f"{key}_peak_buffers": ref["peak_buffers"], f"{key}_peak_live_bytes": ref["peak_live_bytes"],
        "pool": pool.summary() if pool is not None else None,
        "pool_line": pool.line() if pool is not None else None,
    }


def run(args: argparse.Namespace, target: str, device: tuple[str, int], donate: tuple[int, ...],
        pool_device: Any) -> int:
    """The sharded analysis `analyze` delegates to; prints tables or JSON, returns the exit code."""
    import sys

    from jaxmem.reports.terminal import busy
    from jaxmem.xla.sharding import LAYOUTS, parse_mesh, sharded_reference

    unsupported = [flag for flag, value in (("--html", args.html), ("--pprof", args.pprof), ("--png", args.png),
                                             ("--chrome-trace", args.chrome_trace), ("--execute", args.execute),
                                             ("--no-xla", args.no_xla)) if value]
    if unsupported:
        raise PlanError(f"{unsupported[0]} is not available for a program on a mesh yet (per-device tables and --json are)")
    name = device[0].strip().lower()
    xla, note = _xla_kind(args, name)
    if note:
        print(f"jaxmem analyze: {note}", file=sys.stderr)
    on = {"gpu": f"XLA:GPU {name}", "tpu": f"XLA:TPU {name}"}.get(xla, "XLA:CPU")
    if xla == "tpu":
        from jaxmem.runtime.tpu_pool import check_tpu_flags

        check_tpu_flags(args.mem_fraction, args.preallocate, args.allocator, args.steps)
        pool_device = _no_pool
    try:
        dev = pool_device(args, device[1])
    except ConfigError as err:
        print(f"jaxmem analyze: the pool is not simulated: {err}", file=sys.stderr)
        dev = None
    started = time.perf_counter()
    if args.compare_shardings:
        mesh = args.mesh or "8"
        sizes, _ = parse_mesh(mesh)
        layouts = [layout for layout in LAYOUTS if layout != "fsdp_tp" or len(sizes) == 2]
        rows = []
        for layout in layouts:
            with busy(f"compiling {layout} on {mesh} for {on}"):
                ref = sharded_reference(target, device=name, xla=xla, mesh=mesh, layout=layout,
                                        donate_argnums=donate, top=args.top, topology=args.topology)
            # A fresh pool per layout: a simulation leaves its buffers in the device it ran in.
            pool = pool_verdict(ref, pool_device(args, device[1]), args.steps) if dev is not None else None
            rows.append(summarize(ref, pool, target=target, device=device))
        data = {"target": target, "device": device[0], "mesh": mesh, "layouts": rows,
                "total_seconds": time.perf_counter() - started}
        _emit(args, data, render_compare)
        return 0
    with busy(f"compiling per device for {on}"):
        ref = sharded_reference(target, device=name, xla=xla, mesh=args.mesh, layout=args.layout,
                                donate_argnums=donate, top=args.top, topology=args.topology)
    pool = pool_verdict(ref, dev, args.steps) if dev is not None else None
    data = summarize(ref, pool, target=target, device=device)
    data["total_seconds"] = time.perf_counter() - started
    _emit(args, data, render)
    if ref["plan"].get("note"):
        print(f"jaxmem analyze: no per-device plan of jaxmem's (XLA's figures and the pool stand): "
              f"{ref['plan']['note']}", file=sys.stderr)
    if not ref["plan"]["valid"]:
        print("jaxmem analyze: the checker found the per-device plan invalid", file=sys.stderr)
        return 1
    return 0


def _no_pool(args: argparse.Namespace, capacity: int) -> Any:
    """A TPU has no GPU-client pool to set up: its verdict needs only the chip (`pool_verdict`)."""
    return object()


def _emit(args: argparse.Namespace, data: dict[str, Any], renderer: Any) -> None:
    if args.json:
        print(json.dumps(data, indent=2))
        return
    from jaxmem.cli import report_console

    renderer(data, report_console())


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
    if data["peak_bytes"] is None:
        table.add_row("jaxmem plan", "", "", "", "", "not made")
    else:
        table.add_row(f"jaxmem plan ({plan['method']})", "", "", "", "", format_size(data["peak_bytes"]))
    console.print(table)
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
                      "not made" if row["peak_bytes"] is None else format_size(row["peak_bytes"]),
                      format_size(row["replicated_bytes"]), verdict,
                      "cached" if row.get("cached") else f"{xla['compile_seconds']:.1f} s")
    console.print(table)
    fitting = [row["layout"] for row in data["layouts"] if row["pool"] and row["pool"]["fits"]]
    if fitting:
        console.print(f"fits with: {', '.join(LAYOUT_NAMES[f] for f in fitting)}")
    else:
        console.print("[red]no standard layout fits[/]")
