"""Replay speed: events per second through each allocator on a synthetic 1,000,000-event trace.

    .venv/bin/python benchmarks/bench_replay.py            # 1,000,000 events, all allocators
    .venv/bin/python benchmarks/bench_replay.py --events 200000 --allocator caching,bfc

The trace looks like a training loop's: a few dozen tensor sizes from 512 B to 64 MiB (log-
uniform), a live set that wanders around a few hundred blocks, frees in random order; half the
events are allocations, half frees. Each allocator replays it through `jaxmem.traces.replay`
(the full replay: stats, timeline, peak fragmentation), timed with the platform allocator as the
in-run peer, since this machine is shared and absolute times are noisy.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from jaxmem.traces.model import Event, Trace
from jaxmem.traces.replay import ALLOCATORS, _ops, replay_one


def synthetic_trace(n_events: int, seed: int = 0, live_target: int = 300) -> Trace:
    """An alloc/free stream of exactly `n_events` events (even), every block freed by the end."""
    rng = random.Random(seed)
    sizes = sorted({int(2 ** rng.uniform(9, 26)) for _ in range(48)})
    events: list[Event] = []
    live: list[int] = []
    next_addr = 1 << 40
    allocs_left = n_events // 2
    t = 0.0
    while allocs_left or live:
        t += 1.0
        grow = allocs_left and (not live or rng.random() < (0.5 if len(live) > live_target else 0.7))
        if grow:
            size = rng.choice(sizes)
            events.append(Event("alloc", next_addr, size, 0, t, size))
            live.append(next_addr)
            next_addr += 1 << 27      # recorded addresses never collide
            allocs_left -= 1
        else:
            k = rng.randrange(len(live))
            live[k], live[-1] = live[-1], live[k]
            events.append(Event("free", live.pop(), 0, 0, t))
    return Trace(events, source=f"synthetic-{n_events}", format="jaxmem")


def public_pair_rate(trace: Trace, name: str, capacity: int) -> tuple[float, float]:
    """CPU seconds for the stream through the allocator's public allocate/free (a Buffer per
    call) and through its private hooks, nothing else in the loop: the cost of the public pair."""
    from jaxmem.traces.replay import PagedDevice, _make

    out = []
    for public in (True, False):
        alloc, _ = _make(name, trace, capacity, PagedDevice(capacity), None)
        live: dict = {}
        t0 = time.process_time()
        if public:
            allocate, free = alloc.allocate, alloc.free
            for e in trace.events:
                if e.action == "alloc":
                    live[e.addr] = allocate(e.requested)
                else:
                    free(live.pop(e.addr))
        else:
            allocate, free = alloc._allocate, alloc._free
            for e in trace.events:
                if e.action == "alloc":
                    live[e.addr] = allocate(e.requested, 256, 0)
                else:
                    a, s, h = live.pop(e.addr)
                    free(a, s, h, 0)
        out.append(time.process_time() - t0)
    return out[0], out[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--allocator", default="platform,caching,bfc,bfc-growth,caching-expandable")
    p.add_argument("--capacity", type=int, default=80 << 30)
    p.add_argument("--repeat", type=int, default=3, help="best of N runs per allocator")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    trace = synthetic_trace(args.events)
    print(f"synthetic trace: {len(trace.events):,} events built in {time.perf_counter() - t0:.1f} s", flush=True)
    # calibration: this machine is shared, so say how fast plain Python ran during the run
    t0 = time.process_time()
    d = {}
    for i in range(1_000_000):
        d[i] = i
    print(f"calibration: 1,000,000 dict stores took {time.process_time() - t0:.3f} CPU s", flush=True)
    names = [n for n in args.allocator.split(",") if n]
    ops = _ops(trace)
    rates: dict[str, float] = {}
    print("| allocator | events/CPU-s | events/wall-s | CPU s | vs platform (CPU) | peak in use | peak reserved | device allocs |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        if name not in ALLOCATORS:
            raise SystemExit(f"unknown allocator {name!r}")
        cpu = wall = None
        for _ in range(args.repeat):
            w0, c0 = time.perf_counter(), time.process_time()
            run = replay_one(trace, name, capacity=args.capacity, ops=ops)
            c, w = time.process_time() - c0, time.perf_counter() - w0
            cpu = c if cpu is None or c < cpu else cpu
            wall = w if wall is None or w < wall else wall
        assert run.oom is None, run.oom
        n = len(trace.events)
        rates[name] = n / cpu
        peer = f"{rates[name] / rates['platform']:.2f}x" if "platform" in rates else "-"
        print(f"| {name} | {n / cpu:,.0f} | {n / wall:,.0f} | {cpu:.2f} | {peer} | {run.peak_in_use_bytes / 2**30:.2f} GiB "
              f"| {run.peak_reserved_bytes / 2**30:.2f} GiB | {run.device_allocs:,} |", flush=True)
    print()
    print("| allocator | public allocate/free CPU s | private hooks CPU s | cost of the public pair |")
    print("|---|---|---|---|")
    for name in ("caching", "bfc"):
        if name in names:
            pub, hooks = public_pair_rate(trace, name, args.capacity)
            n = len(trace.events)
            print(f"| {name} | {pub:.2f} ({n / pub:,.0f}/s) | {hooks:.2f} ({n / hooks:,.0f}/s) | "
                  f"+{(pub - hooks) / n * 1e9:.0f} ns per event (+{(pub / hooks - 1) * 100:.0f}%) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
