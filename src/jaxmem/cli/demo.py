"""Show the memory pool at work on a built-in training workload: stats, occupancy, a fragmentation OOM.

    jaxmem demo                                   # 80 GiB simulated device, bfc / bfc-growth / platform
    jaxmem demo --capacity h100-80gb --allocator bfc,platform --steps 5
    XLA_PYTHON_CLIENT_PREALLOCATE=false jaxmem demo --from-env    # one pool, set up as JAX would

Part 1 replays the buffer stream of a few training steps (parameters, Adam state, activations,
gradients, un-donated updates) and prints each allocator's `memory_stats()` and the pool's
occupancy at its peak. Part 2 leaves half the pool free in holes and asks for a block larger
than any hole: the out-of-memory error is printed as a user would see it, with its per-bin
table and occupancy strip.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console
from rich.table import Table

from jaxmem.cli import OneLineParser, report_console
from jaxmem.errors import ConfigError, OutOfMemory
from jaxmem.runtime.device import Device
from jaxmem.runtime.dump import bin_summary, occupancy
from jaxmem.runtime.registry import ALLOCATOR_NAMES
from jaxmem.runtime.workload import interleaved_events, run_events, training_events
from jaxmem.units import format_size

# Each demo allocator as (label, Device keyword arguments).
_CHOICES = {
    "bfc": dict(allocator="bfc", preallocate=True),
    "bfc-growth": dict(allocator="bfc-growth"),
    "platform": dict(allocator="platform"),
    "caching": dict(allocator="caching"),
    "caching-expandable": dict(allocator="caching-expandable"),
}

_STAT_ROWS = [
    ("peak bytes in use", "peak_bytes_in_use", format_size),
    ("peak pool bytes", "peak_pool_bytes", format_size),
    ("pool bytes at the end", "pool_bytes", format_size),
    ("bytes limit", "bytes_limit", format_size),
    ("largest free block", "largest_free_block_bytes", format_size),
    ("fragmentation", "fragmentation", lambda v: f"{v:.3f}"),
    ("allocations", "num_allocs", lambda v: f"{v:,}"),
]


def _parser() -> argparse.ArgumentParser:
    doc = (__doc__ or "").strip().splitlines()
    parser = OneLineParser(prog="jaxmem demo", description=doc[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="\n".join(doc[1:]))
    parser.add_argument("--capacity", default="80GiB", help="device size: bytes, '80GiB', or a preset (h100-80gb ...)")
    parser.add_argument("--allocator", default="bfc,bfc-growth,platform",
                        help=f"comma-separated, from: {', '.join(_CHOICES)}")
    parser.add_argument("--mem-fraction", type=float, default=0.75, help="pool cap as a share of capacity")
    parser.add_argument("--from-env", action="store_true",
                        help="one pool configured from XLA_PYTHON_CLIENT_* as JAX would (ignores --allocator, --mem-fraction)")
    parser.add_argument("--layers", type=int, default=24, help="layers of the demo model")
    parser.add_argument("--steps", type=int, default=3, help="training steps to replay")
    parser.add_argument("--seed", type=int, default=0, help="size jitter")
    parser.add_argument("--width", type=int, default=60, help="characters in an occupancy strip")
    return parser


def _devices(args: argparse.Namespace) -> dict[str, Device]:
    if args.layers < 1 or args.steps < 1 or args.width < 8:
        raise ConfigError("--layers and --steps must be at least 1, --width at least 8")
    if args.from_env:
        device = Device.from_env(args.capacity)
        label = device.allocator_name if device.allocator_name != "bfc" or device.preallocate else "bfc-growth"
        return {f"{label} (env)": device}
    names = [n.strip() for n in args.allocator.split(",") if n.strip()]
    if not names:
        raise ConfigError("--allocator names no allocator")
    for name in names:
        if name not in _CHOICES:
            raise ConfigError(f"unknown allocator {name!r}; one of: {', '.join(_CHOICES)}")
    return {n: Device(args.capacity, mem_fraction=args.mem_fraction, **_CHOICES[n]) for n in names}


def _training(console: Console, args: argparse.Namespace) -> None:
    devices = _devices(args)
    first = next(iter(devices.values()))
    limit = int(first.capacity * first.mem_fraction)
    events = training_events(limit, layers=args.layers, steps=args.steps, seed=args.seed)
    allocs = sum(1 for op, _, _ in events if op == "alloc")
    console.print(f"[bold]1. Training workload[/]: {args.steps} steps of a {args.layers}-layer model "
                  f"({allocs:,} allocations) on a simulated {format_size(first.capacity)} device, "
                  f"sized to {format_size(limit)} (mem_fraction {first.mem_fraction}).")
    table = Table(show_header=True, header_style="bold")
    table.add_column("memory_stats()")
    results = {}
    for name, device in devices.items():
        start = time.perf_counter()
        results[name] = run_events(device.allocator, events, width=args.width)
        results[name].seconds = time.perf_counter() - start
        table.add_column(name, justify="right")
    for label, key, fmt in _STAT_ROWS:
        table.add_row(label, *(fmt(r.stats[key]) for r in results.values()))
    table.add_row("device allocations (cudaMalloc)", *(f"{d.allocator.device_allocs:,}" for d in devices.values()))
    table.add_row("failed allocations", *(str(len(r.failures)) for r in results.values()))
    table.add_row("replay time", *(f"{r.seconds * 1e3:.0f} ms" for r in results.values()))
    console.print(table)
    console.print("Pool occupancy at peak use ('*' in use, '_' free; regions end to end):")
    pad = max(map(len, results))
    for name, result in results.items():
        console.print(f"  {name:<{pad}} |{result.peak_occupancy}|", highlight=False, markup=False, soft_wrap=True)
    for name, result in results.items():
        if result.failures:
            console.print(f"  [red]{name}: {len(result.failures)} allocations failed; first: {result.failures[0]}[/]")


def _fragmentation(console: Console, args: argparse.Namespace) -> None:
    devices = _devices(args)
    first = next(iter(devices.values()))
    limit = int(first.capacity * first.mem_fraction)
    # one block per strip cell, so the strip shows the holes one by one
    block = max(256, limit // args.width // 256 * 256 - 156)
    events, request = interleaved_events(limit, block=block)
    console.print()
    console.print(f"[bold]2. Fragmentation[/]: fill the pool with {format_size(block)} blocks, free every "
                  f"other one, then ask for {format_size(request)}.")
    for name, device in devices.items():
        run_events(device.allocator, events, width=args.width)
        stats = device.memory_stats()
        allocs_before = device.allocator.device_allocs
        try:
            buf = device.allocate(request)
        except OutOfMemory as err:
            console.print(f"[bold]{name}[/]: [red]OutOfMemory[/] (free {format_size(stats['pool_bytes'] - stats['bytes_in_use'])}, "
                          f"largest free block {format_size(stats['largest_free_block_bytes'])}):")
            console.print(f"  {err}", highlight=False, markup=False, soft_wrap=True)
            _bins(console, err.chunks, args.width)
        else:
            console.print(f"[bold]{name}[/]: fits at {buf.address:#x}: {_why_fits(device, allocs_before, stats)}")


def _why_fits(device: Device, allocs_before: int, stats: dict) -> str:
    if device.allocator.device_allocs == allocs_before:
        return "a free block in the pool was large enough"
    if stats["largest_free_block_bytes"] == 0 and stats["pool_bytes"] == stats["bytes_in_use"]:
        return "no pool to fragment: the buffer is a device allocation of its own (one driver call each)"
    return (f"the pool took a new device allocation (limit {format_size(stats['bytes_limit'])}, "
            f"pool was {format_size(stats['pool_bytes'])})")


def _bins(console: Console, chunks, width: int) -> None:
    table = Table(title=None, show_header=True, header_style="bold", box=None, padding=(0, 1))
    for column in ("bin", "chunks", "in use", "bytes in chunks", "bytes in use", "largest free"):
        table.add_column(column, justify="right")
    for row in bin_summary(chunks):
        if row["chunks"]:
            table.add_row(f"{format_size(row['min_size'])}+", str(row["chunks"]), str(row["chunks_in_use"]),
                          format_size(row["bytes"]), format_size(row["bytes_in_use"]), format_size(row["largest_free"]))
    console.print(table)
    console.print(f"  occupancy |{occupancy(chunks, width)}|", highlight=False, markup=False, soft_wrap=True)


def main(argv: list[str]) -> int:
    """`jaxmem demo [--capacity C] [--allocator a,b] [--steps N] ...`; returns the exit code."""
    args = _parser().parse_args(argv)
    console = report_console(highlight=False)
    _training(console, args)
    _fragmentation(console, args)
    console.print(f"\nAllocators jaxmem knows: {', '.join(ALLOCATOR_NAMES)}.")
    return 0
