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
from typing import Any, Sequence

from jaxmem.api.sharded import pool_verdict, sharded_reference_of, summarize, xla_kind
from jaxmem.errors import ConfigError, PlanError
from jaxmem.reports.sharded_tables import render, render_compare
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


def run(args: argparse.Namespace, target: str, device: tuple[str, int], donate: tuple[int, ...],
        pool_device: Any, fn: Any, fn_args: Sequence[Any]) -> int:
    """The sharded analysis `analyze` delegates to (`api.sharded`: the factory's `fn(*fn_args)`
    traced here over an AbstractMesh, its text compiled per device in a child); prints tables
    or JSON, returns the exit code."""
    import sys

    from jaxmem.reports.terminal import busy
    from jaxmem.xla.sharding import LAYOUTS, parse_mesh

    unsupported = [flag for flag, value in (("--html", args.html), ("--pprof", args.pprof), ("--png", args.png),
                                             ("--chrome-trace", args.chrome_trace), ("--execute", args.execute),
                                             ("--no-xla", args.no_xla)) if value]
    if unsupported:
        raise PlanError(f"{unsupported[0]} is not available for a program on a mesh yet (per-device tables and --json are)")
    name = device[0].strip().lower()
    xla, note = xla_kind(name, args.xla, args.topology)
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
                ref = sharded_reference_of(fn, fn_args, device=name, xla=xla, mesh=mesh, layout=layout,
                                           donate_argnums=donate, top=args.top, topology=args.topology)
            # A fresh pool per layout: a simulation leaves its buffers in the device it ran in.
            pool = pool_verdict(ref, pool_device(args, device[1]), args.steps) if dev is not None else None
            rows.append(summarize(ref, pool, target=target, device=device))
        data = {"target": target, "device": device[0], "mesh": mesh, "layouts": rows,
                "total_seconds": time.perf_counter() - started}
        _emit(args, data, render_compare)
        return 0
    with busy(f"compiling per device for {on}"):
        ref = sharded_reference_of(fn, fn_args, device=name, xla=xla, mesh=args.mesh, layout=args.layout,
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
