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
from jaxmem.traces.replay import ALLOCATORS, replay_one


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=1_000_000)
    p.add_argument("--allocator", default="platform,caching,bfc,bfc-growth,caching-expandable")
    p.add_argument("--capacity", type=int, default=80 << 30)
    p.add_argument("--repeat", type=int, default=1, help="best of N runs per allocator")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    trace = synthetic_trace(args.events)
    print(f"synthetic trace: {len(trace.events):,} events built in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    names = [n for n in args.allocator.split(",") if n]
    rates: dict[str, float] = {}
    print(f"| allocator | events/s | seconds | vs platform | peak in use | peak reserved | device allocs |")
    print(f"|---|---|---|---|---|---|---|")
    for name in names:
        assert name in ALLOCATORS, name
        best = None
        for _ in range(args.repeat):
            t1 = time.perf_counter()
            run = replay_one(trace, name, capacity=args.capacity)
            dt = time.perf_counter() - t1
            best = dt if best is None or dt < best else best
        assert run.oom is None, run.oom
        rates[name] = len(trace.events) / best
        peer = f"{rates[name] / rates['platform']:.2f}x" if "platform" in rates else "-"
        print(f"| {name} | {rates[name]:,.0f} | {best:.2f} | {peer} | {run.peak_in_use_bytes / 2**30:.2f} GiB "
              f"| {run.peak_reserved_bytes / 2**30:.2f} GiB | {run.device_allocs:,} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
