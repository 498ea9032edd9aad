"""Allocator speed, RMM's random_allocations recipe, on a simulated 80 GiB device.

    .venv/bin/python benchmarks/bench_allocators.py              # the full table
    .venv/bin/python benchmarks/bench_allocators.py --quick      # 10,000 allocations only
    .venv/bin/python benchmarks/bench_allocators.py --profile bfc --max-size 1MiB
    .venv/bin/python benchmarks/bench_allocators.py --allocators bfc --baseline aefe0a8   # before/after
    .venv/bin/python benchmarks/bench_allocators.py --breakdown --counts 10000,100000 --max-size 1MiB

The recipe (rmm/benchmarks/random_allocations): sizes uniform in [1, max_size]; each step
allocates with probability 0.73 while allocations remain and the bytes in use plus the new
size stay under 0.75 x capacity (the BFC pool's limit, the same budget for every allocator);
otherwise, or when the allocation fails, it frees a live buffer chosen at random. 2 x N steps,
then whatever is left is freed. The random draws are made up front with numpy, so the timed
loop is the allocator plus the few list operations RMM's loop does too; the pool's
statistics are read at its end, inside the timing, so that work an allocator defers counts.

Figures are alloc+free pairs per second: allocations made / (time of the loop + the final
frees), timed as the CPU time of the thread that runs the loop (time.thread_time) because the
machine is shared and wall time mostly measures the neighbours (the wall figure of the same
runs is printed too). Not the process's: numpy's OpenBLAS threads spin for a while after
import, and the first run of a process read half its real rate in process CPU time; platform, run in the same invocation, is the peer to compare against. The allocators of
one row take turns run by run, so a change in the machine's load hits them alike.
`--baseline REV` adds "bfc@REV", the BFC pool as committed at git revision REV, loaded
beside the current one: the before/after ratio then comes from one run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import importlib.util
import pstats
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from jaxmem.errors import OutOfMemory
from jaxmem.runtime.allocator import Allocator, Buffer
from jaxmem.runtime.backends import SimulatedBackend
from jaxmem.runtime.device import Device
from jaxmem.units import format_size, parse_size

ALLOCATION_PROBABILITY = 0.73


def draws(num_allocations: int, max_size: int, seed: int) -> tuple[list[int], list[bool], list[float]]:
    """The random numbers one run consumes: sizes, allocate-or-free coins, index fractions."""
    rng = np.random.default_rng(seed)
    steps = 2 * num_allocations
    sizes = rng.integers(1, max_size, size=steps, endpoint=True).tolist()
    coins = (rng.random(steps) < ALLOCATION_PROBABILITY).tolist()
    picks = rng.random(steps).tolist()
    return sizes, coins, picks


def run(allocator: Allocator, num_allocations: int, max_usage: int, randoms) -> tuple[float, float, int, int]:
    """One RMM random_allocations run; returns (CPU seconds, wall seconds, allocations made,
    failed ones)."""
    sizes, coins, picks = randoms
    allocate, free = allocator.allocate, allocator.free
    live: list = []
    in_use = made = failed = 0
    wall, start = time.perf_counter(), time.thread_time()
    for size, coin, pick in zip(sizes, coins, picks):
        do_alloc = (not live) or (coin and made < num_allocations and in_use + size < max_usage)
        if do_alloc:
            try:
                buf = allocate(size)
            except OutOfMemory:
                do_alloc = False
                failed += 1
            else:
                live.append(buf)
                made += 1
                in_use += size
        if not do_alloc and live:
            index = int(pick * len(live))
            live[index], live[-1] = live[-1], live[index]
            buf = live.pop()
            in_use -= buf.requested_size
            free(buf)
    for buf in live:
        free(buf)
    # Read the statistics inside the timing: work an allocator defers (BFC merges the chunks
    # freed into a large free set at the next read) is then counted.
    allocator.memory_stats()
    return time.thread_time() - start, time.perf_counter() - wall, made, failed


def baseline_bfc(rev: str):
    """The BFCAllocator class as committed at git revision `rev`, loaded as its own module."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(["git", "show", f"{rev}:src/jaxmem/runtime/bfc.py"], cwd=root, check=True,
                            capture_output=True, text=True).stdout
    name = f"_bfc_baseline_{rev}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader=None))
    sys.modules[name] = module
    exec(compile(source, f"{rev}:src/jaxmem/runtime/bfc.py", "exec"), module.__dict__)
    return module.BFCAllocator


def make(name: str, capacity: int, baselines: dict) -> Allocator:
    """A fresh allocator: a registry name on a new simulated device, or "bfc@REV"."""
    if "@" in name:  # the old BFC, set up as Device sets up "bfc"
        return baselines[name](SimulatedBackend(capacity), int(capacity * 0.75), preallocate=True)
    return Device(capacity, allocator=name).allocator


def measure(names: list[str], num_allocations: int, max_size: int, capacity: int, seed: int,
            repeat: int, baselines: dict) -> dict[str, tuple[float, float, int]]:
    """Per allocator: best pairs per CPU second and per wall second over `repeat` runs (each on a
    fresh pool; the allocators take turns), and the failed allocations of a run (the same in
    every run: the workload and the allocators are deterministic)."""
    randoms = draws(num_allocations, max_size, seed)
    best = {n: [0.0, 0.0, 0] for n in names}
    for _ in range(repeat):
        for name in names:
            allocator = None
            gc.collect()  # the last run's pool and buffers (a cycle, buffer -> owner) go first, untimed
            allocator = make(name, capacity, baselines)
            # the same budget for every allocator: the BFC pool's limit, 0.75 x capacity
            cpu, wall, made, failed = run(allocator, num_allocations, int(capacity * 0.75), randoms)
            assert allocator.memory_stats()["bytes_in_use"] == 0
            row = best[name]
            row[0], row[1], row[2] = max(row[0], made / cpu), max(row[1], made / wall), failed
    return {n: (r[0], r[1], r[2]) for n, r in best.items()}


class _DriverOnly:
    """No allocator at all: one Buffer handed out again and again (the RMM loop's own cost)."""

    def __init__(self) -> None:
        self.buffer = Buffer(0, 256, 1, 0, self)

    def allocate(self, size: int, *, alignment: int = 256, stream: int = 0) -> Buffer:
        return self.buffer

    def free(self, buffer: Buffer) -> None:
        pass

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_in_use": 0}


class _PublicOnly(Allocator):
    """The public allocate/free pair, its checks, statistics and a new Buffer each time, over a
    policy that does nothing (every buffer at address 0)."""

    def _allocate(self, size: int, alignment: int, stream: int) -> tuple[int, int, object]:
        return 0, (size + 255) & -256, None

    def _free(self, address: int, size: int, handle: object, stream: int) -> None:
        pass

    def _pool_bytes(self) -> int:
        return 0

    def _largest_free_block(self) -> int:
        return 0

    def _chunks(self):
        return iter(())


def breakdown(count: int, max_size: int, capacity: int, seed: int, repeat: int) -> dict[str, float]:
    """CPU microseconds per alloc+free pair of: the RMM loop alone, plus the public pair and its
    Buffers, plus the BFC policy (the whole bfc run), and the bfc run with the cyclic GC off.
    Best of `repeat`, the four taking turns."""
    randoms = draws(count, max_size, seed)
    limit = int(capacity * 0.75)
    makers = {"loop alone": _DriverOnly,
              "+ public pair, Buffers": lambda: _PublicOnly(SimulatedBackend(capacity), limit),
              "+ BFC policy (bfc)": lambda: make("bfc", capacity, {}),
              "bfc, cyclic GC off": lambda: make("bfc", capacity, {})}
    best = {name: float("inf") for name in makers}
    for _ in range(repeat):
        for name, maker in makers.items():
            allocator = None
            gc.collect()
            allocator = maker()
            if name.endswith("GC off"):
                gc.disable()
            try:
                cpu, _, made, _ = run(allocator, count, limit, randoms)
            finally:
                gc.enable()
            best[name] = min(best[name], cpu / made * 1e6)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", default="80GiB")
    parser.add_argument("--allocators", default="bfc,bfc-growth,platform")
    parser.add_argument("--counts", default="10000,100000")
    parser.add_argument("--max-sizes", default="1MiB,64MiB,1GiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="10,000 allocations, one repeat")
    parser.add_argument("--profile", metavar="ALLOCATOR", help="cProfile one run and print the top functions")
    parser.add_argument("--max-size", default="1MiB", help="max size for --profile")
    parser.add_argument("--baseline", metavar="REV", help="also run the BFC pool of git revision REV")
    parser.add_argument("--breakdown", action="store_true",
                        help="CPU us per pair: RMM loop alone, + public pair, + BFC policy (--counts, --max-size)")
    args = parser.parse_args(argv)
    capacity = parse_size(args.capacity)
    if args.profile:
        randoms = draws(100_000, parse_size(args.max_size), args.seed)
        allocator = make(args.profile, capacity, {})
        profiler = cProfile.Profile()
        profiler.enable()
        run(allocator, 100_000, allocator.limit, randoms)
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(12)
        return
    counts = [10_000] if args.quick else [int(c) for c in args.counts.split(",")]
    repeat = 1 if args.quick else args.repeat
    if args.breakdown:
        print(f"CPU microseconds per alloc+free pair, max size {args.max_size}, best of {repeat}")
        for count in counts:
            parts = breakdown(count, parse_size(args.max_size), capacity, args.seed, repeat)
            print(f"{count:>9,} allocations: " + "; ".join(f"{k} {v:.2f}" for k, v in parts.items()), flush=True)
        return
    names = args.allocators.split(",")
    baselines = {}
    if args.baseline:
        names.append(f"bfc@{args.baseline}")
        baselines[names[-1]] = baseline_bfc(args.baseline)
    print(f"simulated device {format_size(capacity)}; pairs per CPU second, best of {repeat} "
          f"(pairs per wall second in brackets); seed {args.seed}")
    print("failed: allocations that failed and were answered with a free, as RMM's recipe does")
    ratios = [("bfc", "platform")] if "bfc" in names and "platform" in names else []
    if args.baseline and "bfc" in names:
        ratios.append(("bfc", names[-1]))
    print(f"{'allocations':>11} {'max size':>9} {'failed':>7} " + " ".join(f"{n:>22}" for n in names)
          + "".join(f" {a + '/' + b:>{max(12, len(a + b) + 1)}}" for a, b in ratios))
    for count in counts:
        for max_size in args.max_sizes.split(","):
            rates = measure(names, count, parse_size(max_size), capacity, args.seed, repeat, baselines)
            failed = rates.get("bfc", next(iter(rates.values())))[2]
            cells = " ".join(f"{f'{cpu:,.0f} ({wall:,.0f})':>22}" for cpu, wall, _ in rates.values())
            shown = "".join(f" {rates[a][0] / rates[b][0]:>{max(12, len(a + b) + 1)}.2f}" for a, b in ratios)
            print(f"{count:>11,} {max_size:>9} {failed:>7,} {cells}{shown}", flush=True)


if __name__ == "__main__":
    main()
